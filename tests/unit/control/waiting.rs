use super::*;
use crate::control::Rendezvous;
use std::thread;

/// Every warning of `rank` about the op `op` comes before the one that says the
/// others arrived, and that one comes (once).
pub(crate) fn warned_then_arrived(op: &str, who: &str, late: &str) {
    let lines = capture::lines(op);
    let mine: Vec<&String> = (lines.iter())
        .filter(|l| l.contains(&format!("{who} has waited")) || l.contains(&format!("{who}: ")))
        .collect();
    let arrived = (mine.iter())
        .position(|l| l.contains(&format!("{late} arrived in {op} after")))
        .unwrap_or_else(|| panic!("{who}: no arrival: {mine:#?}"));
    assert_eq!(
        arrived,
        mine.len() - 1,
        "{who} warned after the arrival: {mine:#?}"
    );
    assert!(arrived >= 2, "{who}: fewer than two warnings: {mine:#?}");
    for l in &mine[..arrived] {
        assert!(
            l.contains(&format!("for {late}, not arrived yet")),
            "{who}: {l}"
        );
    }
}

#[test]
fn a_late_rank_is_named_while_the_others_wait_and_once_more_when_it_comes() {
    capture::install();
    let op = "late-rank rendezvous";
    let rv = Rendezvous::new(3).with_wait_warning_interval(Duration::from_millis(20));
    let deadline = Deadline::after(Duration::from_secs(60));
    thread::scope(|s| {
        let early: Vec<_> = (0..2)
            .map(|rank| {
                let rv = &rv;
                s.spawn(move || rv.gather(op, rank, 1u64, rank, deadline, || false))
            })
            .collect();
        // Each waiting rank names rank 2 at least twice before it comes.
        for rank in 0..2 {
            let who = format!("rank {rank} has waited");
            capture::wait_for(&[op, &who, "for rank 2,"], 2, Duration::from_secs(60));
        }
        assert_eq!(
            rv.gather(op, 2, 1u64, 2, deadline, || false).unwrap(),
            vec![0, 1, 2]
        );
        for h in early {
            assert_eq!(h.join().unwrap().unwrap(), vec![0, 1, 2]);
        }
    });
    for rank in 0..2 {
        warned_then_arrived(op, &format!("rank {rank}"), "rank 2");
    }
    // Rank 2 never waited: it said nothing.
    assert!(
        capture::lines(op)
            .iter()
            .all(|l| !l.contains("rank 2 has waited")),
        "{:#?}",
        capture::lines(op)
    );
}

#[test]
fn ranks_are_named_in_words() {
    assert_eq!(ranks(&[2]), "rank 2");
    assert_eq!(ranks(&[0, 3]), "ranks 0, 3");
    assert_eq!(ranks::<usize>(&[]), "the other ranks");
    let at = |on, at| Who(1, on, at).to_string();
    assert_eq!(at("", ""), "rank 1");
    assert_eq!(
        at("store", "10.0.0.1:29500"),
        "rank 1 (store 10.0.0.1:29500)"
    );
}
