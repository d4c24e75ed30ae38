use super::*;

#[derive(PartialEq)]
struct Pair(u64, &'static str);

impl Fields for Pair {
    const NAMES: &'static [&'static str] = &["number", "name"];
    fn field(&self, i: usize) -> Value {
        match i {
            0 => Value::Number(self.0),
            _ => Value::Name(self.1),
        }
    }
}

#[test]
fn the_first_differing_field_is_named_with_every_rank_value() {
    assert_eq!(first_difference(&[Pair(1, "a"), Pair(1, "a")]), None);
    let (field, values) = first_difference(&[Pair(1, "a"), Pair(1, "b"), Pair(2, "b")]).unwrap();
    assert_eq!(field, "number");
    assert_eq!(values[2], (2, "2".to_string()));
}

#[test]
fn a_malformed_payload_does_not_decode() {
    assert_eq!(decode::<(u64, String)>(&[0xff; 3]), None);
    let bytes = encode(&(7u64, "x".to_string())).unwrap();
    assert_eq!(decode::<(u64, String)>(&bytes), Some((7, "x".into())));
}
