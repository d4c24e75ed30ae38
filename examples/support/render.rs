//! Memory-map pictures: a [`PoolSnapshot`] as a self-contained SVG, and every rank's
//! snapshot side by side with the blocks that differ outlined.
//!
//! Each segment is a row drawn at its own linear scale (the full width is the
//! segment's size) and every block is at least [`MIN_BLOCK_PX`] wide, so a 512 B block
//! stays visible in a 1 GiB segment beside a 2 MiB one; the row's label gives the
//! segment's size, and each block's `<title>` (shown on hover) its allocation number,
//! sizes, offset and stream. Blocks are `<rect class="block STATE">` (`allocated`,
//! `free`, `free_fenced`; `diverged` added in [`render_ranks`]) and segments
//! `<rect class="segment">`.
//!
//! Used by the `memory_map` and `fsdp_step` examples, `tests/observe.rs` and the
//! Python package (`memory_map_svg`, `render_ranks_svg`), each including this file
//! with `#[path]`; it reads the public [`symmpool::observe`] types only.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use symmpool::SizeClass;
use symmpool::observe::{BlockStatus, BlockView, PoolSnapshot, SegmentView};

/// Smallest width of a block in the pictures, in pixels.
pub const MIN_BLOCK_PX: f64 = 2.0;

const WIDTH: f64 = 1280.0;
const LABEL_W: f64 = 250.0;
const MARGIN: f64 = 12.0;
const BAR_W: f64 = WIDTH - LABEL_W - 2.0 * MARGIN;
const ROW_H: f64 = 28.0;
const ROW_GAP: f64 = 8.0;

const STYLE: &str = "
  text { font-family: 'DejaVu Sans', Arial, sans-serif; fill: #222; }
  .title { font-size: 16px; font-weight: bold; }
  .sub { font-size: 12px; fill: #444; }
  .label { font-size: 12px; }
  .small { font-size: 10.5px; fill: #555; }
  .inblock { font-size: 10px; fill: #fff; pointer-events: none; }
  rect.block { stroke: #fff; stroke-width: 0.6; }
  rect.block:hover { stroke: #000; stroke-width: 1.5; }
  .allocated { fill: #3f6fb5; }
  .free { fill: #e4e6ea; }
  .free_fenced { fill: #f0a03c; }
  rect.block.diverged, rect.swatch.diverged { stroke: #e00000; stroke-width: 2.5; }
  rect.swatch { stroke: #999; stroke-width: 0.6; }
  rect.segment { fill: none; stroke: #333; stroke-width: 1; }
  rect.segment.diverged { stroke: #e00000; stroke-width: 2.5; stroke-dasharray: 6 3; }
  .missing { fill: #fff0f0; stroke: #e00000; stroke-dasharray: 6 3; }
  .group { font-size: 12.5px; font-weight: bold; }
  .bad { fill: #c00000; font-weight: bold; }
";

/// `n` bytes for people: `512 B`, `1.5 KiB`, `4.00 MiB`, `1.00 GiB`.
pub fn format_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    match u {
        0 => format!("{n} B"),
        _ if x >= 100.0 => format!("{x:.0} {}", UNITS[u]),
        _ if x >= 10.0 => format!("{x:.1} {}", UNITS[u]),
        _ => format!("{x:.2} {}", UNITS[u]),
    }
}

/// Escape text for XML.
fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            c => o.push(c),
        }
    }
    o
}

/// Widths of the blocks of a row: the linear share of the segment, with every block
/// at least [`MIN_BLOCK_PX`] wide (less only when the row holds more blocks than fit).
fn widths(seg: &SegmentView, bar: f64) -> Vec<f64> {
    let n = seg.blocks.len().max(1) as f64;
    let min = MIN_BLOCK_PX.min(bar / n);
    let rest = bar - min * n;
    let total = seg.size_bytes.max(1) as f64;
    seg.blocks
        .iter()
        .map(|b| min + rest * b.size_bytes as f64 / total)
        .collect()
}

fn class_name(c: SizeClass) -> &'static str {
    match c {
        SizeClass::Small => "small",
        SizeClass::Large => "large",
    }
}

fn block_title(seg: &SegmentView, b: &BlockView, rank: Option<usize>) -> String {
    let mut t = String::new();
    if let Some(r) = rank {
        let _ = write!(t, "rank {r} · ");
    }
    match b.allocation_seq {
        Some(seq) => {
            let _ = write!(t, "allocation #{seq} · ");
        }
        None => t.push_str(match b.state {
            BlockStatus::FreeFenced => "free, fenced (device work may still use it) · ",
            _ => "free · ",
        }),
    }
    let _ = write!(t, "{}", format_bytes(b.size_bytes));
    if b.state == BlockStatus::Allocated {
        let _ = write!(t, " (requested {} B)", b.requested_bytes);
    }
    let _ = write!(
        t,
        " · segment {} offset {} · ",
        seg.id.0,
        format_bytes(b.offset_bytes)
    );
    match b.stream {
        Some(s) => {
            let _ = write!(t, "stream {}", s.0);
        }
        None => t.push_str("no stream"),
    }
    for s in &b.other_streams {
        let _ = write!(t, " +stream {}", s.0);
    }
    t
}

fn segment_title(seg: &SegmentView) -> String {
    let windows: Vec<String> = seg
        .windows
        .iter()
        .map(|w| {
            format!(
                "{} (comm {}): {}",
                w.role,
                w.comm,
                if w.registered {
                    "registered"
                } else {
                    "not registered"
                }
            )
        })
        .collect();
    format!(
        "segment {} · {} · {} · {} · windows: {}",
        seg.id.0,
        class_name(seg.class),
        format_bytes(seg.size_bytes),
        plural(seg.blocks.len(), "block"),
        if windows.is_empty() {
            "none".into()
        } else {
            windows.join(", ")
        }
    )
}

/// The windows of a segment, short: `symmetric ✓ copy_engine ✓ plain –`.
fn windows_short(seg: &SegmentView) -> String {
    let w: Vec<String> = seg
        .windows
        .iter()
        .map(|w| format!("{} {}", w.role, if w.registered { "✓" } else { "–" }))
        .collect();
    if w.is_empty() {
        "no communicators".into()
    } else {
        w.join("  ")
    }
}

/// One row: the blocks of `seg` at `(x, y)`; `diverged(i)` outlines block `i` in red.
fn row(
    out: &mut String,
    seg: &SegmentView,
    x: f64,
    y: f64,
    rank: Option<usize>,
    diverged: &dyn Fn(usize) -> bool,
    segment_diverged: bool,
) {
    let mut bx = x;
    for (i, (b, w)) in seg.blocks.iter().zip(widths(seg, BAR_W)).enumerate() {
        let extra = if diverged(i) { " diverged" } else { "" };
        let _ = write!(
            out,
            r#"<rect class="block {}{extra}" x="{bx:.2}" y="{y:.2}" width="{w:.2}" height="{ROW_H}"><title>{}</title></rect>"#,
            b.state.name(),
            esc(&block_title(seg, b, rank)),
        );
        // A label inside the block when it fits (about 6 px per character): the
        // allocation number and size, or the number alone.
        if b.state == BlockStatus::Allocated {
            let seq = b
                .allocation_seq
                .map(|s| format!("#{s}"))
                .unwrap_or_default();
            let long = format!("{seq} {}", format_bytes(b.size_bytes));
            let fits = |l: &str| w > l.chars().count() as f64 * 6.0 + 6.0;
            let label = [long, seq].into_iter().find(|l| fits(l));
            if let Some(label) = label {
                let _ = write!(
                    out,
                    r#"<text class="inblock" x="{:.2}" y="{:.2}">{}</text>"#,
                    bx + 4.0,
                    y + ROW_H / 2.0 + 3.5,
                    esc(&label)
                );
            }
        }
        out.push('\n');
        bx += w;
    }
    let cls = if segment_diverged {
        "segment diverged"
    } else {
        "segment"
    };
    let _ = writeln!(
        out,
        r#"<rect class="{cls}" x="{x:.2}" y="{y:.2}" width="{BAR_W:.2}" height="{ROW_H}"><title>{}</title></rect>"#,
        esc(&segment_title(seg))
    );
}

fn legend(out: &mut String, y: f64, with_diverged: bool) -> f64 {
    let mut x = MARGIN;
    let mut items = vec![
        ("swatch allocated", "allocated"),
        ("swatch free", "free"),
        (
            "swatch free_fenced",
            "free, fenced (device work may still use it)",
        ),
    ];
    if with_diverged {
        items.push((
            "swatch free diverged",
            "differs from rank 0 (placement diverged)",
        ));
    }
    for (cls, text) in items {
        let _ = write!(
            out,
            r#"<rect class="{cls}" x="{x}" y="{y}" width="22" height="14"/><text class="sub" x="{}" y="{}">{}</text>"#,
            x + 28.0,
            y + 11.5,
            esc(text)
        );
        x += 40.0 + text.len() as f64 * 6.6;
    }
    out.push('\n');
    let _ = writeln!(
        out,
        r#"<text class="small" x="{MARGIN}" y="{}">Scale: each row is one segment at its own linear scale (full width = the segment's size, given at the left); every block is at least {MIN_BLOCK_PX} px wide, so 1 KiB stays visible beside 1 GiB.</text>"#,
        y + 32.0
    );
    let _ = writeln!(
        out,
        r#"<text class="small" x="{MARGIN}" y="{}">Hover a block for its allocation number, size, requested bytes, offset and stream; hover a segment's outline for its windows. Labels: #allocation size.</text>"#,
        y + 47.0
    );
    y + 62.0
}

/// The document around `body`, whose content ends at `bottom`.
fn document(body: &str, bottom: f64) -> String {
    let (width, height) = (WIDTH, (bottom + MARGIN).ceil());
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\">\n<style>{STYLE}</style>\n<rect x=\"0\" y=\"0\" width=\"{width}\" height=\"{height}\" fill=\"#fff\"/>\n{body}</svg>\n"
    )
}

fn plural(n: usize, one: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {one}s")
    }
}

fn stat(s: &PoolSnapshot, key: &str) -> u64 {
    s.stats.get(key).and_then(|v| v.as_u64()).unwrap_or(0)
}

fn summary_line(s: &PoolSnapshot) -> String {
    format!(
        "{} segments, {} reserved (peak {}) · {} allocated in {} blocks (peak {}) · {} free in split segments",
        s.segments.len(),
        format_bytes(stat(s, "reserved_bytes.all.current")),
        format_bytes(stat(s, "reserved_bytes.all.peak")),
        format_bytes(stat(s, "allocated_bytes.all.current")),
        stat(s, "allocation.all.current"),
        format_bytes(stat(s, "allocated_bytes.all.peak")),
        format_bytes(stat(s, "inactive_split_bytes.all.current")),
    )
}

fn row_label(out: &mut String, y: f64, first: &str, second: &str) {
    let _ = write!(
        out,
        r#"<text class="label" x="{MARGIN}" y="{:.2}">{}</text><text class="small" x="{MARGIN}" y="{:.2}">{}</text>"#,
        y + 11.5,
        esc(first),
        y + 25.0,
        esc(second)
    );
}

/// One rank's memory map as a self-contained SVG document: a row per segment, the
/// blocks coloured by state, a `<title>` per block and segment, a legend.
pub fn render_svg(snapshot: &PoolSnapshot) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<text class="title" x="{MARGIN}" y="22">symmpool memory map · pool {} · rank {} of {}</text><text class="sub" x="{MARGIN}" y="40">{}</text>"#,
        esc(&format!("{:?}", snapshot.pool)),
        snapshot.rank,
        snapshot.world_size,
        esc(&summary_line(snapshot))
    );
    let mut y = legend(&mut out, 50.0, false);
    if snapshot.segments.is_empty() {
        let _ = writeln!(
            out,
            r#"<text class="sub" x="{MARGIN}" y="{}">no segments</text>"#,
            y + 16.0
        );
        y += 24.0;
    }
    for seg in &snapshot.segments {
        let _ = writeln!(out, r#"<g class="segment-row" id="segment-{}">"#, seg.id.0);
        row_label(
            &mut out,
            y,
            &format!(
                "segment {} · {} · {}",
                seg.id.0,
                class_name(seg.class),
                format_bytes(seg.size_bytes)
            ),
            &windows_short(seg),
        );
        row(&mut out, seg, MARGIN + LABEL_W, y, None, &|_| false, false);
        out.push_str("</g>\n");
        y += ROW_H + ROW_GAP;
    }
    document(&out, y)
}

/// What makes two ranks' blocks the same placement: offset, size, allocated or not,
/// allocation number. (Streams and fences may differ between ranks.)
type Key = (u64, u64, bool, Option<u64>);

fn key(b: &BlockView) -> Key {
    (
        b.offset_bytes,
        b.size_bytes,
        b.state == BlockStatus::Allocated,
        b.allocation_seq,
    )
}

fn find(snap: &PoolSnapshot, id: u32) -> Option<&SegmentView> {
    snap.segments.iter().find(|s| s.id.0 == id)
}

/// Blocks that differ between the ranks: per (rank index, segment id), the indices of
/// the blocks with no identical block at the same place on the reference (the first
/// snapshot) or, for the reference, missing on some other rank.
fn divergence(snaps: &[PoolSnapshot]) -> BTreeMap<(usize, u32), BTreeSet<usize>> {
    let mut out: BTreeMap<(usize, u32), BTreeSet<usize>> = BTreeMap::new();
    let Some(reference) = snaps.first() else {
        return out;
    };
    let keys = |s: &SegmentView| -> BTreeSet<Key> { s.blocks.iter().map(key).collect() };
    for (r, snap) in snaps.iter().enumerate().skip(1) {
        for seg in &snap.segments {
            let theirs = find(reference, seg.id.0).map(keys).unwrap_or_default();
            let mine = keys(seg);
            for (i, b) in seg.blocks.iter().enumerate() {
                if !theirs.contains(&key(b)) {
                    out.entry((r, seg.id.0)).or_default().insert(i);
                }
            }
            if let Some(rseg) = find(reference, seg.id.0) {
                for (i, b) in rseg.blocks.iter().enumerate() {
                    if !mine.contains(&key(b)) {
                        out.entry((0, seg.id.0)).or_default().insert(i);
                    }
                }
            }
        }
    }
    out
}

/// Every rank's memory map in one SVG document: for each segment id a group of rows,
/// one per snapshot (rank) in the order given, so that a placement divergence shows
/// at a glance. Blocks that differ from the first snapshot's (offset, size,
/// allocated or not, allocation number) are outlined in red (`class="block … diverged"`);
/// a segment missing on a rank is a dashed red row, and a segment whose size or class
/// differs has a red dashed outline.
pub fn render_ranks(snapshots: &[PoolSnapshot]) -> String {
    let ids: BTreeSet<u32> = snapshots
        .iter()
        .flat_map(|s| s.segments.iter().map(|g| g.id.0))
        .collect();
    let diff = divergence(snapshots);
    let mut out = String::new();
    let differing: usize = diff.values().map(BTreeSet::len).sum();
    let missing = ids
        .iter()
        .filter(|id| {
            snapshots
                .iter()
                .any(|s| !s.segments.iter().any(|g| g.id.0 == **id))
        })
        .count();
    let pool = snapshots
        .first()
        .map(|s| s.pool.clone())
        .unwrap_or_default();
    let verdict = if differing == 0 && missing == 0 {
        "placement identical on every rank".to_string()
    } else {
        format!("{differing} blocks differ, {missing} segments missing on some rank")
    };
    let _ = writeln!(
        out,
        r#"<text class="title" x="{MARGIN}" y="22">symmpool memory map · pool {} · {} ranks side by side</text><text class="{}" x="{MARGIN}" y="40">{}</text>"#,
        esc(&format!("{pool:?}")),
        snapshots.len(),
        if verdict.starts_with("placement") {
            "sub"
        } else {
            "sub bad"
        },
        esc(&verdict)
    );
    let mut y = legend(&mut out, 50.0, true);
    for id in ids {
        let reference = snapshots
            .first()
            .and_then(|s| s.segments.iter().find(|g| g.id.0 == id));
        let _ = writeln!(out, r#"<g class="segment-group" id="segment-{id}">"#);
        let head = match reference {
            Some(seg) => format!(
                "segment {id} · {} · {} · {}",
                class_name(seg.class),
                format_bytes(seg.size_bytes),
                windows_short(seg)
            ),
            None => format!("segment {id}"),
        };
        let _ = writeln!(
            out,
            r#"<text class="group" x="{MARGIN}" y="{:.2}">{}</text>"#,
            y + 12.0,
            esc(&head)
        );
        y += 18.0;
        for (r, snap) in snapshots.iter().enumerate() {
            let label = format!("rank {}", snap.rank);
            match snap.segments.iter().find(|g| g.id.0 == id) {
                Some(seg) => {
                    row_label(&mut out, y, &label, &plural(seg.blocks.len(), "block"));
                    let bad = diff.get(&(r, id));
                    let seg_bad = reference
                        .is_none_or(|g| g.size_bytes != seg.size_bytes || g.class != seg.class);
                    row(
                        &mut out,
                        seg,
                        MARGIN + LABEL_W,
                        y,
                        Some(snap.rank),
                        &|i| bad.is_some_and(|b| b.contains(&i)),
                        seg_bad,
                    );
                }
                None => {
                    row_label(&mut out, y, &label, "segment missing");
                    let _ = writeln!(
                        out,
                        r#"<rect class="missing" x="{:.2}" y="{y:.2}" width="{BAR_W:.2}" height="{ROW_H}"><title>rank {}: segment {id} missing</title></rect>"#,
                        MARGIN + LABEL_W,
                        snap.rank
                    );
                }
            }
            y += ROW_H + 4.0;
        }
        out.push_str("</g>\n");
        y += ROW_GAP;
    }
    document(&out, y)
}
