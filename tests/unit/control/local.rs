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
    assert_eq!(group[0].shared.rounds_held(), 0);
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
