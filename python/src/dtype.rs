//! Element types as Python gives them: a string (`"float32"`, `"f32"`, …) or a torch
//! dtype (`torch.float32`, …), read without importing torch.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

/// An element type the reductions support.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DType {
    /// IEEE binary32 (`float32`, `torch.float32`, `torch.float`).
    F32,
    /// bfloat16 (`bfloat16`, `torch.bfloat16`).
    BF16,
    /// IEEE binary16 (`float16`, `torch.float16`, `torch.half`).
    F16,
    /// Unsigned bytes (`uint8`, `torch.uint8`).
    U8,
}

/// What the error names as supported.
const SUPPORTED: &str = "float32, bfloat16, float16 and uint8 (as strings such as \"float32\" or \
                         \"f32\", or torch dtypes such as torch.float32)";

impl DType {
    /// The type a name stands for: numpy's and torch's names (`"float32"`, `"half"`),
    /// the crate's short ones (`"f32"`), with or without a `torch.` prefix.
    pub(crate) fn from_name(name: &str) -> Option<DType> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        Some(match name {
            "f32" | "float32" | "float" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" | "half" => DType::F16,
            "u8" | "uint8" => DType::U8,
            _ => return None,
        })
    }
}

impl<'py> FromPyObject<'py> for DType {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        let name = if let Ok(s) = ob.downcast::<PyString>() {
            s.to_str()?.to_owned()
        } else if is_torch_dtype(ob)? {
            // `str(torch.float32)` is "torch.float32".
            ob.str()?.to_str()?.to_owned()
        } else {
            return Err(PyTypeError::new_err(format!(
                "dtype must be a string or a torch.dtype, not {}",
                ob.get_type().name()?
            )));
        };
        DType::from_name(&name).ok_or_else(|| {
            PyValueError::new_err(format!(
                "unsupported dtype {name}: supported are {SUPPORTED}"
            ))
        })
    }
}

/// Whether `ob` is a `torch.dtype` (its type is `dtype` of module `torch`).
fn is_torch_dtype(ob: &Bound<'_, PyAny>) -> PyResult<bool> {
    let ty = ob.get_type();
    Ok(ty.name()?.to_str()? == "dtype" && ty.module()?.to_str()? == "torch")
}

#[cfg(test)]
mod tests {
    use super::DType;

    #[test]
    fn names() {
        assert_eq!(DType::from_name("torch.bfloat16"), Some(DType::BF16));
        assert_eq!(DType::from_name("f32"), Some(DType::F32));
        assert_eq!(DType::from_name("torch.half"), Some(DType::F16));
        assert_eq!(DType::from_name("torch.float64"), None);
    }
}
