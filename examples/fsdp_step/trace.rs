//! The timeline (`--trace FILE`): per stream and per layer, when each GEMM, collective,
//! copy and wait ran on the device, and the host calls around them, written as a
//! Chrome-trace JSON file (open it in <https://ui.perfetto.dev> or chrome://tracing).
//!
//! - Device spans come from a pair of markers around each operation ([`Math::mark`]:
//!   CUDA events with timing on GPUs), read after the step's closing synchronisation
//!   against one reference marker recorded at the start of the step; the step itself
//!   never waits for them. A `wait` span on a stream is the time that stream stood
//!   still waiting for another (from the marker before `cuStreamWaitEvent` to the one
//!   after).
//! - Host spans are the calls as the rank's thread made them (`host` row), and the
//!   whole step (`step`).
//! - Times are µs since the Unix epoch minus the earliest span of the file, so the ranks
//!   of one machine line up, threads or processes; a device span is placed by its
//!   distance from the step's reference marker, which the device reaches as soon as the
//!   host records it (the streams are idle between steps).
//!
//! Beside it, `FILE.svg` draws the last traced step of rank 0, one block per mode.
//!
//! In the file: `pid` is the rank, `tid` the row (0 host, 1 compute, 2 all-gather,
//! 3 reduce-scatter, named by `thread_name` metadata), `cat` the mode, `args` the mode,
//! step and layer. The first (warm-up) step of each mode is not traced. Recording costs
//! two event records per operation on the host, so a traced step is a little slower
//! than an untraced one.

use super::cli::{Args, Mode};
use super::trainer::{Math, On};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use symmpool::Result;

/// A row of the timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Lane {
    /// The rank's host thread.
    Host,
    /// A device stream.
    Stream(On),
}

impl Lane {
    /// The Chrome-trace `tid`.
    pub fn tid(self) -> u32 {
        match self {
            Lane::Host => 0,
            Lane::Stream(On::Compute) => 1,
            Lane::Stream(On::AllGather) => 2,
            Lane::Stream(On::ReduceScatter) => 3,
        }
    }

    /// The row's name.
    pub fn name(self) -> &'static str {
        match self {
            Lane::Host => "host",
            Lane::Stream(on) => on.name(),
        }
    }
}

/// One span of the timeline.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Span {
    /// What ran: `gemm`, `gemm dW`, `gemm dX`, `all-gather`, `reduce-scatter`, `copy`,
    /// `loss`, `sgd`, `wait`, `alloc`, `sync`, `step`.
    pub name: String,
    /// The rank.
    pub rank: usize,
    /// The row.
    pub lane: Lane,
    /// Start, in µs since the Unix epoch.
    pub start_us: f64,
    /// Duration, in µs.
    pub dur_us: f64,
    /// The mode.
    pub mode: Mode,
    /// The step.
    pub step: usize,
    /// The layer, if the span belongs to one.
    pub layer: Option<usize>,
}

/// µs since the Unix epoch of an `Instant` (through one pairing of the two clocks per
/// process).
fn wall_us(t: Instant) -> f64 {
    static ORIGIN: std::sync::OnceLock<(Instant, f64)> = std::sync::OnceLock::new();
    let (i0, w0) = *ORIGIN.get_or_init(|| {
        let w = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        (Instant::now(), w.as_secs_f64() * 1e6)
    });
    if t >= i0 {
        w0 + t.duration_since(i0).as_secs_f64() * 1e6
    } else {
        w0 - i0.duration_since(t).as_secs_f64() * 1e6
    }
}

/// A device span not yet read: its stream, name, layer and two markers.
struct Pending<K> {
    on: On,
    name: &'static str,
    layer: Option<usize>,
    begin: K,
    end: K,
}

/// One rank's recorder for one mode: spans of the current step, resolved after it.
pub struct Recorder<K> {
    rank: usize,
    mode: Mode,
    step: usize,
    /// The step's reference marker (compute stream) and the host time it was recorded.
    reference: Option<(K, f64)>,
    pending: Vec<Pending<K>>,
    /// Resolved spans.
    pub spans: Vec<Span>,
}

impl<K> std::fmt::Debug for Recorder<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("rank", &self.rank)
            .field("mode", &self.mode)
            .field("spans", &self.spans.len())
            .finish_non_exhaustive()
    }
}

impl<K> Recorder<K> {
    /// A recorder of `rank`'s steps in `mode`.
    pub fn new(rank: usize, mode: Mode) -> Self {
        Recorder {
            rank,
            mode,
            step: 0,
            reference: None,
            pending: Vec::new(),
            spans: Vec::new(),
        }
    }

    fn host_span(&mut self, name: &str, layer: Option<usize>, t0: Instant, t1: Instant) {
        self.spans.push(Span {
            name: name.into(),
            rank: self.rank,
            lane: Lane::Host,
            start_us: wall_us(t0),
            dur_us: t1.duration_since(t0).as_secs_f64() * 1e6,
            mode: self.mode,
            step: self.step,
            layer,
        });
    }
}

/// Start step `step`: the reference marker, on the compute stream.
///
/// # Errors
/// Recording the marker failed.
pub fn begin_step<M: Math>(tr: &mut Option<Recorder<M::Mark>>, m: &M, step: usize) -> Result<()> {
    if let Some(r) = tr {
        r.step = step;
        let t = Instant::now();
        r.reference = Some((m.mark(On::Compute)?, wall_us(t)));
    }
    Ok(())
}

/// Run `f`, which enqueues `name` on stream `on`: with a recorder, between two
/// markers on `on` (the device span) and two host clock reads (the host span).
///
/// # Errors
/// `f`'s, or recording a marker failed.
pub fn op<M: Math, R>(
    tr: &mut Option<Recorder<M::Mark>>,
    m: &M,
    on: On,
    name: &'static str,
    layer: Option<usize>,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let Some(r) = tr else {
        return f();
    };
    let t0 = Instant::now();
    let begin = m.mark(on)?;
    let out = f()?;
    let end = m.mark(on)?;
    r.host_span(name, layer, t0, Instant::now());
    r.pending.push(Pending {
        on,
        name,
        layer,
        begin,
        end,
    });
    Ok(out)
}

/// Run `f` on the host (no device span): its host span only.
///
/// # Errors
/// `f`'s.
pub fn host<K, R>(
    tr: &mut Option<Recorder<K>>,
    name: &'static str,
    layer: Option<usize>,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let Some(r) = tr else {
        return f();
    };
    let t0 = Instant::now();
    let out = f()?;
    r.host_span(name, layer, t0, Instant::now());
    Ok(out)
}

/// After the step's synchronisation: read every marker against the reference and
/// record the step's host span (from `start`).
///
/// # Errors
/// Reading a marker failed.
pub fn end_step<M: Math>(tr: &mut Option<Recorder<M::Mark>>, m: &M, start: Instant) -> Result<()> {
    let Some(r) = tr else {
        return Ok(());
    };
    r.host_span("step", None, start, Instant::now());
    let Some((reference, ref_us)) = r.reference.take() else {
        return Ok(());
    };
    for p in std::mem::take(&mut r.pending) {
        let begin_us = m.elapsed_us(&reference, &p.begin)?;
        let end_us = m.elapsed_us(&reference, &p.end)?;
        r.spans.push(Span {
            name: p.name.into(),
            rank: r.rank,
            lane: Lane::Stream(p.on),
            start_us: ref_us + begin_us,
            dur_us: (end_us - begin_us).max(0.0),
            mode: r.mode,
            step: r.step,
            layer: p.layer,
        });
    }
    Ok(())
}

/// Every rank's spans in this process (ranks as threads), until written.
static SPANS: Mutex<Vec<Span>> = Mutex::new(Vec::new());

/// Keep `spans` for the file.
pub fn keep(spans: Vec<Span>) {
    SPANS.lock().extend(spans);
}

/// Take every span kept so far.
pub fn take() -> Vec<Span> {
    std::mem::take(&mut *SPANS.lock())
}

/// The Chrome-trace JSON of `spans`.
pub fn chrome_json(spans: &[Span]) -> serde_json::Value {
    use serde_json::json;
    let origin = spans
        .iter()
        .map(|s| s.start_us)
        .fold(f64::INFINITY, f64::min);
    let mut events = Vec::new();
    let mut rows: BTreeMap<usize, Vec<Lane>> = BTreeMap::new();
    for s in spans {
        let lanes = rows.entry(s.rank).or_default();
        if !lanes.contains(&s.lane) {
            lanes.push(s.lane);
        }
        events.push(json!({
            "name": s.name,
            "cat": s.mode.name(),
            "ph": "X",
            "ts": s.start_us - origin,
            "dur": s.dur_us,
            "pid": s.rank,
            "tid": s.lane.tid(),
            "args": { "mode": s.mode.name(), "step": s.step, "layer": s.layer },
        }));
    }
    for (rank, mut lanes) in rows {
        lanes.sort();
        events.push(
            json!({ "ph": "M", "name": "process_name", "pid": rank, "tid": 0,
            "args": { "name": format!("rank {rank}") } }),
        );
        for lane in lanes {
            events.push(json!({ "ph": "M", "name": "thread_name", "pid": rank,
                "tid": lane.tid(), "args": { "name": lane.name() } }));
            events.push(json!({ "ph": "M", "name": "thread_sort_index", "pid": rank,
                "tid": lane.tid(), "args": { "sort_index": lane.tid() } }));
        }
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// Write `spans` to `path` as Chrome-trace JSON, and a picture of one step of rank 0
/// per mode beside it (`PATH.svg`, see [`svg`]).
///
/// # Errors
/// Writing a file failed.
pub fn write(path: &std::path::Path, spans: &[Span]) -> std::io::Result<()> {
    let json = serde_json::to_vec(&chrome_json(spans)).map_err(std::io::Error::other)?;
    std::fs::write(path, json)?;
    std::fs::write(svg_path(path), svg(spans, 0))
}

/// Total length of the union of `[start, end)` intervals.
fn union_len(mut v: Vec<(f64, f64)>) -> f64 {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut total, mut cur): (f64, Option<(f64, f64)>) = (0.0, None);
    for (s, e) in v {
        match &mut cur {
            Some((_, ce)) if s <= *ce => *ce = ce.max(e),
            _ => {
                if let Some((cs, ce)) = cur {
                    total += ce - cs;
                }
                cur = Some((s, e));
            }
        }
    }
    total + cur.map_or(0.0, |(s, e)| e - s)
}

/// The intervals of `spans` (device work: waits left out) in lanes `lanes`.
fn busy(spans: &[&Span], lanes: &[On]) -> Vec<(f64, f64)> {
    (spans.iter())
        .filter(|s| s.name != "wait" && lanes.iter().any(|&l| s.lane == Lane::Stream(l)))
        .map(|s| (s.start_us, s.start_us + s.dur_us))
        .collect()
}

/// Median of `v` (0 for none).
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    (v[(v.len() - 1) / 2] + v[v.len() / 2]) / 2.0
}

/// What the trace says, per mode, for rank `rank`: a table, one line per mode, of
/// means per traced step (ms): the step (host), each stream's busy time, how much of
/// the communication ran beside compute, and the host's time per call.
pub fn summary(spans: &[Span], rank: usize) -> String {
    let mut by_mode: BTreeMap<&'static str, Vec<&Span>> = BTreeMap::new();
    let mut order: Vec<Mode> = Vec::new();
    for s in spans.iter().filter(|s| s.rank == rank) {
        by_mode.entry(s.mode.name()).or_default().push(s);
        if !order.contains(&s.mode) {
            order.push(s.mode);
        }
    }
    let mut out = format!(
        "trace summary, rank {rank} (per traced step, mean; ms unless µs):\n\
         {:<5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>9} {:>9} {:>9} {:>9}\n",
        "mode",
        "step",
        "compute",
        "gather",
        "scatter",
        "exposed",
        "hidden",
        "host µs",
        "host µs",
        "host µs",
        "end sync",
    );
    out += &format!(
        "{:<5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>9} {:>9} {:>9} {:>9}\n",
        "", "", "busy", "busy", "busy", "comm", "comm", "/ gather", "/ scatter", "/ gemm", "ms"
    );
    for mode in order {
        let all = &by_mode[mode.name()];
        let mut steps: Vec<usize> = all.iter().map(|s| s.step).collect();
        steps.dedup();
        steps.sort_unstable();
        steps.dedup();
        let n = steps.len().max(1) as f64;
        let (mut step, mut compute, mut ag, mut rs, mut exposed, mut comm) =
            (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
        for &k in &steps {
            let of_step: Vec<&Span> = all.iter().copied().filter(|s| s.step == k).collect();
            step += (of_step.iter())
                .filter(|s| s.lane == Lane::Host && s.name == "step")
                .map(|s| s.dur_us)
                .sum::<f64>();
            let c = busy(&of_step, &[On::Compute]);
            let m = busy(&of_step, &[On::AllGather, On::ReduceScatter]);
            let (cu, mu) = (union_len(c.clone()), union_len(m.clone()));
            compute += cu;
            ag += union_len(busy(&of_step, &[On::AllGather]));
            rs += union_len(busy(&of_step, &[On::ReduceScatter]));
            comm += mu;
            // Communication not beside compute: |comm ∪ compute| − |compute|.
            exposed += union_len([c, m].concat()) - cu;
        }
        let host_per = |name: &str| {
            median(
                (all.iter())
                    .filter(|s| s.lane == Lane::Host && s.name.starts_with(name))
                    .map(|s| s.dur_us)
                    .collect(),
            )
        };
        let sync = (all.iter())
            .filter(|s| s.lane == Lane::Host && s.name == "sync")
            .map(|s| s.dur_us)
            .sum::<f64>();
        let hidden = if comm > 0.0 {
            format!("{:.0}%", 100.0 * (1.0 - exposed / comm))
        } else {
            "-".into()
        };
        let ms = |us: f64| format!("{:.3}", us / n / 1e3);
        out += &format!(
            "{:<5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>9}\n",
            mode.name(),
            ms(step),
            ms(compute),
            ms(ag),
            ms(rs),
            ms(exposed),
            hidden,
            host_per("all-gather"),
            host_per("reduce-scatter"),
            host_per("gemm"),
            ms(sync),
        );
    }
    out += "(busy: union of a stream's operations; exposed comm: communication with the \
            compute stream idle; hidden: the rest of it; host µs: median per call; end \
            sync: the host waiting for the device at the end of the step)";
    out
}

/// With ranks as processes: gather every rank's spans on rank 0, which writes the file
/// and prints the summary (stderr).
///
/// # Errors
/// The exchange failed, or writing the file.
pub fn gather(exchange: &dyn symmpool::Exchange, args: &Args) -> Result<()> {
    let Some(path) = &args.trace else {
        return Ok(());
    };
    let internal = |what: String| symmpool::Error::Internal { what };
    let mine = serde_json::to_vec(&take()).map_err(|e| internal(format!("a trace: {e}")))?;
    let deadline = symmpool::Deadline::after(symmpool::GroupConfig::default().timeout);
    let channel = exchange.open_channel("fsdp_step:trace", deadline)?;
    let all = exchange.all_gather(channel, "trace", &mine, deadline)?;
    if exchange.rank() == 0 {
        let mut spans = Vec::new();
        for bytes in all {
            let v: Vec<Span> = serde_json::from_slice(&bytes)
                .map_err(|e| internal(format!("a rank's trace: {e}")))?;
            spans.extend(v);
        }
        write(path, &spans)
            .map_err(|e| internal(format!("writing the trace to {}: {e}", path.display())))?;
        eprintln!("trace: {}\n{}", path.display(), summary(&spans, 0));
    }
    Ok(())
}

/// The colour of an operation in the picture.
fn colour(name: &str) -> &'static str {
    match name {
        n if n.starts_with("gemm") => "#4e79a7",
        "all-gather" => "#59a14f",
        "reduce-scatter" => "#f28e2b",
        "sgd" => "#b07aa1",
        "copy" | "loss" => "#76b7b2",
        "wait" => "#d0d0d0",
        "sync" => "#e15759",
        _ => "#bab0ac",
    }
}

/// Escape `s` for SVG text.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A picture of one step per mode (the last traced step of `rank`): a row per stream
/// and one for the host calls, time left to right, each operation a box named by its
/// layer (`wait` boxes grey: a stream standing still). SVG.
pub fn svg(spans: &[Span], rank: usize) -> String {
    use std::fmt::Write as _;
    let (width, row_h, label_w) = (1200.0f64, 22.0f64, 110.0f64);
    let lanes = [
        Lane::Host,
        Lane::Stream(On::Compute),
        Lane::Stream(On::AllGather),
        Lane::Stream(On::ReduceScatter),
    ];
    let mut modes: Vec<Mode> = Vec::new();
    for s in spans.iter().filter(|s| s.rank == rank) {
        if !modes.contains(&s.mode) {
            modes.push(s.mode);
        }
    }
    let block_h = row_h * (lanes.len() as f64 + 1.5);
    let height = block_h * modes.len() as f64 + 30.0;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" \
         font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" \
         fill=\"white\"/>\n",
        width + label_w + 10.0
    );
    for (i, mode) in modes.iter().enumerate() {
        let of_mode: Vec<&Span> = (spans.iter())
            .filter(|s| s.rank == rank && s.mode == *mode)
            .collect();
        let Some(step) = of_mode.iter().map(|s| s.step).max() else {
            continue;
        };
        let of_step: Vec<&&Span> = of_mode.iter().filter(|s| s.step == step).collect();
        let t0 = of_step
            .iter()
            .map(|s| s.start_us)
            .fold(f64::INFINITY, f64::min);
        let t1 = (of_step.iter())
            .map(|s| s.start_us + s.dur_us)
            .fold(f64::NEG_INFINITY, f64::max);
        let scale = width / (t1 - t0).max(1.0);
        let y0 = 10.0 + i as f64 * block_h;
        let _ = writeln!(
            out,
            "<text x=\"4\" y=\"{:.1}\" font-weight=\"bold\">{}, rank {rank}, step {step}: \
             {:.3} ms</text>",
            y0 + 12.0,
            mode.name(),
            (t1 - t0) / 1e3
        );
        for (r, lane) in lanes.iter().enumerate() {
            let y = y0 + row_h * (r as f64 + 1.0);
            let _ = writeln!(
                out,
                "<text x=\"4\" y=\"{:.1}\">{}</text>",
                y + row_h * 0.7,
                lane.name()
            );
            for s in of_step
                .iter()
                .filter(|s| s.lane == *lane && s.name != "step")
            {
                let x = label_w + (s.start_us - t0) * scale;
                let w = (s.dur_us * scale).max(0.5);
                let layer = s.layer.map_or(String::new(), |l| format!(" {l}"));
                let title = format!("{}{layer}: {:.1} µs", s.name, s.dur_us);
                let _ = write!(
                    out,
                    "<rect x=\"{x:.2}\" y=\"{:.1}\" width=\"{w:.2}\" height=\"{:.1}\" \
                     fill=\"{}\" stroke=\"white\" stroke-width=\"0.3\"><title>{}</title></rect>",
                    y + 1.0,
                    row_h - 2.0,
                    colour(&s.name),
                    escape(&title)
                );
                if w > 24.0 {
                    let _ = write!(
                        out,
                        "<text x=\"{:.2}\" y=\"{:.1}\" fill=\"white\">{}</text>",
                        x + 2.0,
                        y + row_h * 0.7,
                        escape(&format!("{}{layer}", s.name))
                    );
                }
                out.push('\n');
            }
        }
    }
    out += "</svg>\n";
    out
}

/// The picture's path: `path` with `.svg` appended.
pub fn svg_path(path: &std::path::Path) -> std::path::PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".svg");
    p.into()
}
