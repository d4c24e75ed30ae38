//! The wire protocol's tests: messages, frames and the fuzz entry.

use super::*;
use std::io::{self, Read};

/// Byte vectors written as byte strings are the bytes postcard writes for a
/// sequence of `u8`: the frames on the wire did not change.
#[test]
fn byte_strings_keep_the_wire_format() {
    #[derive(Serialize)]
    enum PlainServer {
        _Hello,
        Contribute {
            epoch: u64,
            channel: u64,
            round: u64,
            op: String,
            payload: Vec<u8>,
        },
    }
    #[derive(Serialize)]
    enum PlainClient {
        _Welcome,
        _Reject,
        _Joined,
        _AllJoined,
        Result {
            channel: u64,
            round: u64,
            payloads: Vec<Vec<u8>>,
        },
    }
    let payloads: Vec<Vec<u8>> = vec![vec![], (0..=255).collect(), vec![7; 300]];
    let ours = encode(&ToClient::Result {
        channel: 3,
        round: 1 << 40,
        payloads: payloads.iter().cloned().map(ByteBuf::from).collect(),
    });
    let plain = encode(&PlainClient::Result {
        channel: 3,
        round: 1 << 40,
        payloads: payloads.clone(),
    });
    assert_eq!(ours, plain);
    match decode::<ToClient>(&ours[4..]) {
        Ok(ToClient::Result { payloads: back, .. }) => assert_eq!(back, payloads),
        other => panic!("{other:?}"),
    }
    let contribute = |payload: Vec<u8>| ToServer::Contribute {
        epoch: 0,
        channel: 1,
        round: 2,
        op: "op".into(),
        payload,
    };
    let ours = encode(&contribute(payloads[1].clone()));
    let plain = encode(&PlainServer::Contribute {
        epoch: 0,
        channel: 1,
        round: 2,
        op: "op".into(),
        payload: payloads[1].clone(),
    });
    assert_eq!(ours, plain);
    assert!(matches!(
        decode::<ToServer>(&ours[4..]),
        Ok(ToServer::Contribute { payload, .. }) if payload == payloads[1]
    ));
}

#[test]
fn frames_round_trip_across_short_reads() {
    let mut bytes = Vec::new();
    for i in 0..50u64 {
        bytes.extend(encode(&ToClient::Result {
            channel: i,
            round: i * 3,
            payloads: vec![ByteBuf::from(vec![i as u8; (i * 37) as usize]); 3],
        }));
    }
    // A reader that returns at most 7 bytes at a time.
    struct Trickle(Vec<u8>, usize);
    impl Read for Trickle {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let n = out.len().min(7).min(self.0.len() - self.1);
            out[..n].copy_from_slice(&self.0[self.1..self.1 + n]);
            self.1 += n;
            Ok(n)
        }
    }
    let mut r = FrameReader::new(Trickle(bytes, 0), 1 << 20);
    for i in 0..50u64 {
        let body = r.frame().unwrap().unwrap();
        match decode::<ToClient>(&body).unwrap() {
            ToClient::Result {
                channel,
                round,
                payloads,
            } => {
                assert_eq!((channel, round), (i, i * 3));
                assert_eq!(payloads, vec![vec![i as u8; (i * 37) as usize]; 3]);
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(matches!(r.frame(), Err(ReadError::Eof { partial: false })));
}

#[test]
fn an_oversized_length_is_refused_before_allocating() {
    let mut r = FrameReader::new(&[0xff, 0xff, 0xff, 0x7f, 1, 2][..], 4096);
    assert!(matches!(
        r.frame(),
        Err(ReadError::TooLarge {
            max_bytes: 4096,
            ..
        })
    ));
    assert!(r.buf.len() <= 4096);
}

#[test]
fn a_truncated_frame_is_a_partial_eof() {
    let mut r = FrameReader::new(&[10, 0, 0, 0, 1, 2][..], 4096);
    assert!(matches!(r.frame(), Err(ReadError::Eof { partial: true })));
}

#[test]
fn garbage_does_not_decode_and_prefaces_are_checked() {
    assert!(decode::<ToServer>(&[0xff, 0xee, 0x01]).is_err());
    assert!(check_preface(&preface()).is_ok());
    assert!(
        check_preface(b"GET / HTTP/1.1")
            .unwrap_err()
            .contains("magic")
    );
    let mut p = preface();
    p[8] = 8;
    assert!(check_preface(&p).unwrap_err().contains("version 8"));
}

#[test]
fn the_fuzz_entry_takes_frames_garbage_and_nothing() {
    fuzz_frames(&[]);
    fuzz_frames(&[3, 1, 2, 3]);
    let mut data = vec![0x22];
    data.extend(preface());
    data.extend(encode(&ToServer::Hello {
        token: b"t".to_vec(),
        job: "j".into(),
        rank: 1,
        world_size: 2,
        host: "h".into(),
        pid: 7,
        joining: true,
    }));
    data.extend(encode(&ToClient::Reject {
        reason: "r".into(),
        kind: Refusal::RankTaken {
            rank: 1,
            holder: Member {
                host: "a".into(),
                pid: 1,
                addr: "x".into(),
                at_unix_ms: 1 << 40,
            },
            claimant: Member {
                host: "b".into(),
                pid: 2,
                addr: "y".into(),
                at_unix_ms: 0,
            },
        },
        job: "j".into(),
    }));
    data.extend(u32::MAX.to_le_bytes());
    fuzz_frames(&data);
    data[0] = 0x10;
    fuzz_frames(&data);
}

proptest::proptest! {
    /// The fuzz target's checks, on random inputs (with and without a valid
    /// preface) where cargo-fuzz is not at hand.
    #[test]
    fn the_frame_decoder_keeps_its_promises_on_random_bytes(
        mode: u8,
        valid_preface: bool,
        rest in proptest::collection::vec(proptest::num::u8::ANY, 0..600),
    ) {
        let mut data = vec![mode];
        if valid_preface {
            data.extend(preface());
        }
        data.extend(rest);
        fuzz_frames(&data);
    }
}

#[test]
fn times_print_as_utc() {
    assert_eq!(utc(0), "1970-01-01 00:00:00.000 UTC");
    assert_eq!(utc(951_782_400_123), "2000-02-29 00:00:00.123 UTC");
    assert_eq!(utc(1_796_115_723_456), "2026-12-01 09:02:03.456 UTC");
}

#[test]
fn tokens_compare_by_content() {
    assert!(constant_time_eq(b"abc", b"abc"));
    assert!(!constant_time_eq(b"abc", b"abd"));
    assert!(!constant_time_eq(b"abc", b"abcd"));
    assert!(!constant_time_eq(b"", b"\0"));
    assert!(constant_time_eq(b"", b""));
}
