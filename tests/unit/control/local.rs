use super::*;
use crate::control::Exchange;
use crate::deadline::Deadline;
use crate::error::Error;
use std::thread;
use std::time::Duration;

#[test]
fn nothing_is_left_behind_after_a_timeout() {
    let group = LocalExchange::group(2);
    let ch = ChannelId::CONTROL;
    assert!(matches!(
        group[0].all_gather(ch, "t", &[7], Deadline::after(Duration::from_millis(20))),
        Err(Error::Timeout { .. })
    ));
    assert!(matches!(
        group[1].all_gather(ch, "t", &[8], Deadline::after(Duration::from_secs(5))),
        Err(Error::GroupBroken { rank: 0, .. })
    ));
    assert_eq!(group[0].group.rounds.rounds_held(), 0);
}

#[test]
fn endless_timeouts_return_once_every_rank_arrives() {
    let group = LocalExchange::group(3);
    thread::scope(|s| {
        let hs: Vec<_> = group
            .iter()
            .map(|ex| {
                s.spawn(move || {
                    let ch = ex.open_channel("endless", Deadline::never())?;
                    let mine = [ex.rank() as u8];
                    ex.all_gather(ch, "endless", &mine, Deadline::never())
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap().unwrap(), vec![vec![0], vec![1], vec![2]]);
        }
    });
}

#[test]
fn different_channels_are_a_mismatch_naming_each_rank() {
    let group = LocalExchange::group(2);
    let got: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = group
            .iter()
            .map(|ex| {
                let name = if ex.rank() == 0 { "a" } else { "b" };
                s.spawn(move || ex.open_channel(name, Deadline::after(Duration::from_secs(5))))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for g in got {
        match g {
            Err(Error::ChannelMismatch { opened }) => assert_eq!(
                opened,
                vec![(0, 1, "a".to_string()), (1, 1, "b".to_string())]
            ),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn an_undecodable_opening_is_an_error_naming_the_rank() {
    let group = LocalExchange::group(2);
    let got = thread::scope(|s| {
        let opener =
            s.spawn(|| group[0].open_channel("a", Deadline::after(Duration::from_secs(5))));
        let garbage = s.spawn(|| {
            group[1].all_gather(
                ChannelId::CONTROL,
                "open_channel",
                &[0xff; 3],
                Deadline::after(Duration::from_secs(5)),
            )
        });
        (opener.join().unwrap(), garbage.join().unwrap())
    });
    match got.0 {
        Err(Error::Protocol { detail, .. }) => assert!(detail.contains("rank 1"), "{detail}"),
        other => panic!("{other:?}"),
    }
    assert!(got.1.is_ok());
}

impl LocalExchange {
    /// Wait until `n` ranks ask to shrink, or `deadline`; whether they do.
    fn wait_for_asks(&self, n: usize, deadline: Deadline) -> bool {
        let mut st = self.group.state.lock();
        let g = &self.group;
        g.cv.wait_while_until(&mut st, |st| st.votes.len() < n, deadline.instant());
        st.votes.len() >= n
    }
}

#[path = "../../common/round.rs"]
mod round;
use round::{LONG, round};

#[test]
fn a_dropped_rank_is_lost_to_the_others_at_once() {
    let mut group = LocalExchange::group(3);
    let third = group.remove(2);
    let started = std::time::Instant::now();
    let lost = thread::scope(|s| {
        let waiting = s.spawn(|| round(&group[0], 0));
        // Rank 0 may be waiting already or not yet: it fails either way, long before
        // its deadline.
        drop(third);
        waiting.join().unwrap()
    });
    assert!(
        matches!(lost, Err(Error::PeerLost { rank: 2, .. })),
        "{lost:?}"
    );
    assert!(matches!(
        round(&group[1], 1),
        Err(Error::PeerLost { rank: 2, .. })
    ));
    assert!(started.elapsed() < LONG / 2);
    let peer = Exchange::lost_peer(&group[1]).expect("a lost peer");
    assert_eq!((peer.rank, peer.left), (2, true));
}

#[test]
fn a_rank_whose_thread_panics_is_lost_and_did_not_leave() {
    let mut group = LocalExchange::group(2);
    let victim = group.remove(1);
    let panicked = thread::spawn(move || {
        let _held = victim;
        panic!("a rank's thread panics");
    })
    .join();
    assert!(panicked.is_err());
    let peer = Exchange::lost_peer(&group[0]).expect("a lost peer");
    assert_eq!((peer.rank, peer.left), (1, false));
    assert!(peer.detail.contains("panicked"), "{}", peer.detail);
}

#[test]
fn the_survivors_shrink_into_a_dense_group_and_the_old_one_is_shrunk() {
    let mut group = LocalExchange::group(4);
    drop(group.remove(1));
    let shrunk: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = (group.iter())
            .map(|x| s.spawn(|| x.shrink(Deadline::after(LONG)).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ranks: Vec<_> = shrunk.iter().map(|x| (x.rank(), x.world_size())).collect();
    assert_eq!(ranks, [(0, 3), (1, 3), (2, 3)]);
    assert!(Arc::ptr_eq(
        &group[2].shrink(Deadline::after(LONG)).unwrap(),
        &shrunk[2]
    ));
    let out: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = (shrunk.iter())
            .map(|x| s.spawn(|| round(x.as_ref(), 10 + x.rank() as u8)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in out {
        assert_eq!(r.unwrap(), vec![vec![10], vec![11], vec![12]]);
    }
    assert!(matches!(round(&group[0], 0), Err(Error::Shrunk { .. })));
    assert!(Exchange::lost_peer(shrunk[0].as_ref()).is_none());
}

#[test]
fn a_loss_while_the_survivors_ask_fails_their_shrink_and_they_can_ask_again() {
    let mut group = LocalExchange::group(3);
    let third = group.remove(2);
    let (first, again) = thread::scope(|s| {
        let hs: Vec<_> = (group.iter())
            .map(|x| {
                s.spawn(|| {
                    let first = x.shrink(Deadline::after(LONG)).map(|_| ());
                    let again = x.shrink(Deadline::after(LONG)).map(|n| n.world_size());
                    (first, again)
                })
            })
            .collect();
        // Both survivors are asking when rank 2 goes.
        assert!(group[0].wait_for_asks(2, Deadline::after(LONG)));
        drop(third);
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .unzip::<_, _, Vec<_>, Vec<_>>()
    });
    for f in first {
        match f {
            Err(Error::ShrinkFailed {
                reason,
                retry: true,
            }) => {
                assert!(reason.contains("rank 2 was lost"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(again.iter().all(|a| matches!(a, Ok(2))), "{again:?}");
}

#[test]
fn a_survivor_that_does_not_ask_times_the_shrink_out_naming_it() {
    let group = LocalExchange::group(2);
    let out = group[0].shrink(Deadline::after(Duration::from_millis(50)));
    match out.map(|_| ()) {
        Err(Error::Timeout { missing_ranks, .. }) => assert_eq!(missing_ranks, [1]),
        other => panic!("{other:?}"),
    }
    // The ask was withdrawn: both asking now shrink the group whole.
    let sizes: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = (group.iter())
            .map(|x| s.spawn(|| x.shrink(Deadline::after(LONG)).map(|n| n.world_size())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(sizes.iter().all(|s| matches!(s, Ok(2))), "{sizes:?}");
}

/// Every exchange's `grow(wait)`, each on a thread of its own.
fn grow_all(group: &[LocalExchange], wait: bool) -> Vec<Result<Option<Arc<LocalExchange>>>> {
    thread::scope(|s| {
        let hs: Vec<_> = (group.iter())
            .map(|ex| s.spawn(move || ex.grow(wait, Deadline::after(Duration::from_secs(10)))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_grow_admits_the_waiting_newcomers_after_the_ranks_and_rounds_pair_across_all() {
    let group = LocalExchange::group(2);
    let newcomer = group[1].newcomer();
    let (grown, joined) = thread::scope(|s| {
        let joined = s.spawn(|| newcomer.join(Deadline::after(Duration::from_secs(10))));
        (grow_all(&group, true), joined.join().unwrap().unwrap())
    });
    let mut all: Vec<_> = grown.into_iter().map(|g| g.unwrap().unwrap()).collect();
    all.push(joined);
    let places: Vec<_> = all.iter().map(|e| (e.rank(), e.world_size())).collect();
    assert_eq!(places, [(0, 3), (1, 3), (2, 3)]);
    // Asking again gives the same exchange; the old one refuses rounds.
    let again = group[0]
        .grow(false, Deadline::after(Duration::from_secs(1)))
        .unwrap();
    assert!(Arc::ptr_eq(&again.unwrap(), &all[0]));
    let ch = ChannelId::CONTROL;
    let old = group[0].all_gather(ch, "t", &[1], Deadline::after(Duration::from_secs(1)));
    assert!(matches!(old, Err(Error::Shrunk { .. })), "{old:?}");
    let out: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = (all.iter())
            .map(|e| {
                s.spawn(move || {
                    e.all_gather(
                        ch,
                        "t",
                        &[e.rank() as u8],
                        Deadline::after(Duration::from_secs(10)),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    assert!(out.iter().all(|o| *o == [vec![0], vec![1], vec![2]]));
}

#[test]
fn without_a_newcomer_a_grow_is_none_and_a_dropped_newcomer_is_no_loss() {
    let group = LocalExchange::group(2);
    drop(group[0].newcomer());
    for g in grow_all(&group, false) {
        assert!(matches!(g, Ok(None)), "{g:?}");
    }
    assert!(Exchange::lost_peer(&group[0]).is_none());
    // A newcomer nobody admits gives up at its deadline.
    let late = group[0]
        .newcomer()
        .join(Deadline::after(Duration::from_millis(50)));
    assert!(
        matches!(late, Err(Error::Timeout { op: "join", .. })),
        "{late:?}"
    );
    // It gave up: a later grow does not take it in.
    for g in grow_all(&group, false) {
        assert!(matches!(g, Ok(None)), "{g:?}");
    }
}

#[test]
fn a_newcomer_dropped_after_the_grow_took_it_in_is_lost_to_the_grown_group() {
    let group = LocalExchange::group(2);
    let newcomer = group[0].newcomer();
    let grown: Vec<_> = grow_all(&group, true)
        .into_iter()
        .map(|g| g.unwrap().unwrap())
        .collect();
    assert!(Exchange::lost_peer(&*grown[0]).is_none());
    drop(newcomer);
    let lost = Exchange::lost_peer(&*grown[0]).map(|p| p.rank);
    assert_eq!(lost, Some(2));
}

/// Every rank asked to grow and waits for a newcomer: the first whose deadline passes
/// ends the wait for all of them, `None` on every rank (as on a store), never `None`
/// on one and a timeout naming it on the others.
#[test]
fn the_first_rank_to_give_up_waiting_for_a_newcomer_ends_the_wait_for_all() {
    let group = LocalExchange::group(2);
    let started = std::time::Instant::now();
    let (long, short) = thread::scope(|s| {
        let long = s.spawn(|| group[1].grow(true, Deadline::after(Duration::from_secs(20))));
        assert!(group[0].wait_for_asks(1, Deadline::after(Duration::from_secs(10))));
        let short = group[0].grow(true, Deadline::after(Duration::from_millis(100)));
        (long.join().unwrap(), short)
    });
    for g in [long, short] {
        assert!(matches!(g, Ok(None)), "{g:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_rank_lost_while_the_others_ask_to_grow_is_a_peer_lost_and_they_can_shrink() {
    let mut group = LocalExchange::group(3);
    let last = group.pop().unwrap();
    let out = thread::scope(|s| {
        let hs: Vec<_> = (group.iter())
            .map(|ex| s.spawn(move || ex.grow(true, Deadline::after(Duration::from_secs(10)))))
            .collect();
        drop(last);
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for o in out {
        assert!(matches!(o, Err(Error::PeerLost { rank: 2, .. })), "{o:?}");
    }
    let shrunk: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = (group.iter())
            .map(|ex| s.spawn(move || ex.shrink(Deadline::after(Duration::from_secs(10)))))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap().unwrap().world_size())
            .collect()
    });
    assert_eq!(shrunk, [2, 2]);
}
