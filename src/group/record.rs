//! Records the ranks compare, and the one way they are compared: field by field, in
//! order, the first differing field named with each rank's value.
//!
//! Records travel as serde values (`postcard`) over the [`Exchange`](crate::Exchange);
//! a payload that does not decode is reported as such, never as a panic.

use crate::error::{Error, Result};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A value of one field, as compared and as shown in an error.
#[derive(PartialEq)]
pub(crate) enum Value {
    /// A count, a size, an offset.
    Number(u64),
    /// A hash or digest (shown in hexadecimal).
    Hex(u64),
    /// A named choice (an operation, a type, a path).
    Name(&'static str),
    /// A caller's tag of a call (`None`: untagged), shown in decimal and hexadecimal.
    Tag(Option<u64>),
}

impl Value {
    /// The value as an error shows it.
    pub(crate) fn show(&self) -> String {
        match self {
            Value::Tag(None) => "no tag".to_string(),
            Value::Tag(Some(v)) => format!("tag {v} ({v:#x})"),
            Value::Number(v) => v.to_string(),
            Value::Hex(v) => format!("{v:#018x}"),
            Value::Name(s) => (*s).to_string(),
        }
    }
}

/// A record the ranks compare field by field.
pub(crate) trait Fields {
    /// The fields' names, in the order they are compared.
    const NAMES: &'static [&'static str];

    /// Field number `i` (an index into [`NAMES`](Self::NAMES)).
    fn field(&self, i: usize) -> Value;

    /// Field number `i` as an error shows it (by default its value shown); a record
    /// may say more here than it compares.
    fn describe(&self, i: usize) -> String {
        self.field(i).show()
    }
}

/// The first field where the ranks' records differ: its name and each rank's value.
pub(crate) fn first_difference<R: Fields + PartialEq>(
    records: &[R],
) -> Option<(&'static str, Vec<(usize, String)>)> {
    let first = records.first()?;
    // The common case, cheaply: every rank made the same record.
    if records.iter().all(|r| r == first) {
        return None;
    }
    (0..R::NAMES.len()).find_map(|i| {
        let mine = first.field(i);
        if records.iter().all(|r| r.field(i) == mine) {
            return None;
        }
        let values = (records.iter().enumerate()).map(|(rank, r)| (rank, r.describe(i)));
        Some((R::NAMES[i], values.collect()))
    })
}

/// A record as bytes for the exchange.
pub(crate) fn encode<T: Serialize + ?Sized>(record: &T) -> Result<Vec<u8>> {
    postcard::to_allocvec(record)
        .map_err(|e| Error::internal(format!("encoding a record for the other ranks failed: {e}")))
}

/// As [`encode`], into a buffer of `max_bytes` made at once (serialising into a slice
/// is several times faster than growing a vector byte by byte); a value that does not
/// fit falls back to [`encode`].
pub(crate) fn encode_sized<T: Serialize + ?Sized>(value: &T, max_bytes: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; max_bytes];
    match postcard::to_slice(value, &mut buf) {
        Ok(used) => {
            let n = used.len();
            buf.truncate(n);
            Ok(buf)
        }
        Err(_) => encode(value),
    }
}

/// A peer's record, or `None` if its payload does not decode.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    postcard::from_bytes(bytes).ok()
}

#[cfg(test)]
#[path = "../../tests/unit/group/record.rs"]
mod tests;
