use super::*;
use crate::control::Exchange;
use crate::deadline::Deadline;
use parking_lot::Condvar;
use std::collections::HashMap;
use std::sync::Arc;

/// An in-memory store with c10d's semantics.
#[derive(Debug, Default)]
struct Mem {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
}

impl KvStore for Arc<Mem> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.map.lock().insert(key.into(), value.to_vec());
        self.cv.notify_all();
        Ok(())
    }
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        Ok(self.map.lock()[key].clone())
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut m = self.map.lock();
        let v = m.get(key).map_or(0, |v| {
            String::from_utf8_lossy(v).parse::<i64>().unwrap_or(0)
        }) + delta;
        m.insert(key.into(), v.to_string().into_bytes());
        self.cv.notify_all();
        Ok(v)
    }
    fn wait(&self, keys: &[String], timeout: Duration) -> Result<bool> {
        let deadline = Deadline::after(timeout);
        let mut m = self.map.lock();
        loop {
            if keys.iter().all(|k| m.contains_key(k)) {
                return Ok(true);
            }
            if deadline.expired() {
                return Ok(false);
            }
            self.cv.wait_until(&mut m, deadline.instant());
        }
    }
    fn delete(&self, key: &str) -> Result<()> {
        self.map.lock().remove(key);
        Ok(())
    }
}

fn group(world: usize) -> (Arc<Mem>, Vec<KvExchange<Arc<Mem>>>) {
    let mem = Arc::new(Mem::default());
    let cfg = KvConfig::new("t").with_poll(Duration::from_millis(20));
    let ex = (0..world)
        .map(|r| KvExchange::new(mem.clone(), r, world, cfg.clone()).unwrap())
        .collect();
    (mem, ex)
}

#[test]
fn rounds_gather_in_rank_order_and_keys_are_deleted() {
    let (mem, ex) = group(3);
    std::thread::scope(|s| {
        for e in &ex {
            s.spawn(move || {
                let ch = e
                    .open_channel("pool:a", Deadline::after(Duration::from_secs(5)))
                    .unwrap();
                assert_eq!(ch.ordinal(), 1);
                for round in 0..5u8 {
                    let got = e
                        .all_gather(
                            ch,
                            "t",
                            &[e.rank() as u8, round],
                            Deadline::after(Duration::from_secs(5)),
                        )
                        .unwrap();
                    let want: Vec<Vec<u8>> = (0..3).map(|r| vec![r as u8, round]).collect();
                    assert_eq!(got, want);
                }
                // Endless timeouts: a channel opened and a round gathered with
                // `Duration::MAX` return once every rank is there.
                let endless = e.open_channel("pool:endless", Deadline::never()).unwrap();
                let got = e.all_gather(endless, "t", &[e.rank() as u8], Deadline::never());
                assert_eq!(got.unwrap(), vec![vec![0], vec![1], vec![2]]);
            });
        }
    });
    // Only the last round's keys of the channel remain.
    let map = mem.map.lock();
    let keys: Vec<_> = map.keys().filter(|k| k.starts_with("t/1/")).collect();
    assert_eq!(keys.len(), 3, "{keys:?}");
}

#[test]
fn a_late_rank_is_named_while_the_others_wait() {
    use crate::control::waiting::capture;
    capture::install();
    let mem = Arc::new(Mem::default());
    let cfg = KvConfig::new("late")
        .with_poll(Duration::from_millis(20))
        .with_wait_warning_interval(Duration::from_millis(30));
    let ex: Vec<_> = (0..3)
        .map(|r| KvExchange::new(mem.clone(), r, 3, cfg.clone()).unwrap())
        .collect();
    let op = "late-rank kv round";
    let round = |e: &KvExchange<Arc<Mem>>| {
        e.all_gather(
            ChannelId::CONTROL,
            op,
            &[e.rank() as u8],
            Deadline::after(Duration::from_secs(60)),
        )
    };
    std::thread::scope(|s| {
        let early: Vec<_> = ex[..2].iter().map(|e| s.spawn(move || round(e))).collect();
        for rank in 0..2 {
            let who = format!("rank {rank} (key-value store late) has waited");
            capture::wait_for(&[op, &who, "for rank 2,"], 2, Duration::from_secs(60));
        }
        assert_eq!(round(&ex[2]).unwrap(), vec![vec![0], vec![1], vec![2]]);
        for h in early {
            assert_eq!(h.join().unwrap().unwrap(), vec![vec![0], vec![1], vec![2]]);
        }
    });
    for rank in 0..2 {
        let who = format!("rank {rank} (key-value store late)");
        crate::control::waiting::tests::warned_then_arrived(op, &who, "rank 2");
    }
}

#[test]
fn a_timeout_breaks_the_group_for_everyone() {
    let (_mem, ex) = group(3);
    let short = Duration::from_millis(100);
    std::thread::scope(|s| {
        // Rank 2 never comes; rank 0 times out first, rank 1 learns of it.
        let e0 = &ex[0];
        let h0 = s
            .spawn(move || e0.all_gather(ChannelId::CONTROL, "grow", b"x", Deadline::after(short)));
        let e1 = &ex[1];
        let h1 = s.spawn(move || {
            e1.all_gather(
                ChannelId::CONTROL,
                "grow",
                b"y",
                Deadline::after(Duration::from_secs(30)),
            )
        });
        match h0.join().unwrap() {
            Err(Error::Timeout { missing_ranks, .. }) => assert_eq!(missing_ranks, vec![2]),
            other => panic!("{other:?}"),
        }
        match h1.join().unwrap() {
            Err(Error::GroupBroken {
                rank: 0,
                op: "grow",
            }) => {}
            other => panic!("{other:?}"),
        }
    });
    // A late rank fails too, on any channel.
    assert!(matches!(
        ex[2].all_gather(ChannelId::CONTROL, "grow", b"z", Deadline::after(short)),
        Err(Error::GroupBroken { rank: 0, .. })
    ));
}
