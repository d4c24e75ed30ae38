"""Which NCCL libraries this process has mapped (``/proc/self/maps``)."""

import os


def nccl_libraries(maps_path="/proc/self/maps"):
    """The distinct ``libnccl`` files mapped into this process, sorted."""
    found = set()
    try:
        with open(maps_path) as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and "libnccl" in os.path.basename(parts[5].strip()):
                    found.add(parts[5].strip())
    except OSError:
        return []
    return sorted(found)


def nccl_mappings(maps_path="/proc/self/maps"):
    """How many distinct NCCL libraries are mapped: 1 inside PyTorch once symmpool has
    loaded NCCL (it binds to PyTorch's copy); 2 would mean a second copy."""
    return len(nccl_libraries(maps_path))
