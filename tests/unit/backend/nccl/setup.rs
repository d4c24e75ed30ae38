use super::*;
use crate::control::LocalExchange;

fn id(b: u8) -> Vec<u8> {
    (0..128u8).map(|i| i.wrapping_mul(b)).collect()
}

#[test]
fn unique_ids_reach_every_rank_over_an_exchange() {
    let ids = vec![id(3), id(7), id(11)];
    let results: Vec<Result<Agreed>> = std::thread::scope(|s| {
        let hs: Vec<_> = LocalExchange::group(3)
            .into_iter()
            .map(|ex| {
                let ids = ids.clone();
                s.spawn(move || {
                    let rank = ex.rank();
                    let hello = Hello {
                        version: 22809,
                        node: format!("node{}", rank / 2),
                        // Ranks 0 and 2 on one GPU (on different nodes: a UUID is
                        // unique over every host).
                        device: vec![(rank % 2) as u8; 16],
                        unique_ids: if rank == 0 { ids } else { Vec::new() },
                        role: Role::New,
                        plan: "p".into(),
                    };
                    agree(
                        &ex,
                        &hello,
                        Deadline::after(std::time::Duration::from_secs(10)),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        let a = r.unwrap();
        assert_eq!(a.version, NcclVersion::new(2, 28, 9));
        assert_eq!(a.placement.nodes, 2);
        assert!(a.placement.shared_devices);
        assert_eq!(a.unique_ids.len(), 3);
        for (got, want) in a.unique_ids.iter().zip(&ids) {
            assert_eq!(&got[..], &want[..]);
        }
    }
}

#[test]
fn different_versions_fail_on_every_rank() {
    let h = |version| Hello {
        version,
        node: "n".into(),
        device: Vec::new(),
        unique_ids: vec![],
        role: Role::New,
        plan: "p".into(),
    };
    match settle(&[h(22803), h(22809)]) {
        Err(Error::Config { value: m, .. }) => {
            assert!(
                m.contains("rank 0: 2.28.3") && m.contains("rank 1: 2.28.9"),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
    let bad = Hello {
        unique_ids: vec![vec![0; 12]],
        ..h(22803)
    };
    assert!(matches!(settle(&[bad]), Err(Error::Protocol { .. })));
    let other = Hello {
        plan: "q".into(),
        ..h(22803)
    };
    assert!(matches!(
        settle(&[h(22803), other]),
        Err(Error::Config { value: m, .. }) if m.contains("different data communicators")
    ));
    let one = settle(&[h(22803)]).unwrap();
    assert_eq!(
        (one.placement, one.unique_ids.len()),
        (Placement::ONE_NODE, 0)
    );
}

#[test]
fn a_grow_takes_the_roots_id_and_numbers_the_newcomers_after_the_members() {
    let h = |role, ids: Vec<Vec<u8>>| Hello {
        version: 23206,
        node: "n".into(),
        device: Vec::new(),
        unique_ids: ids,
        role,
        plan: "p".into(),
    };
    let member = |parent_rank| Role::Member { parent_rank };
    // Job ranks 0..4, rank 1 a newcomer: members keep their parent ranks (here 2, 0, 1:
    // the parent was itself grown), the newcomer comes after them; the root (parent
    // rank 0, rank 2 here) sent the id, not rank 0.
    let hellos = [
        h(member(2), vec![]),
        h(Role::Newcomer, vec![]),
        h(member(0), vec![id(5)]),
        h(member(1), vec![]),
    ];
    let a = settle(&hellos).unwrap();
    assert_eq!(a.grow, Some(vec![2, 3, 0, 1]));
    assert_eq!(&a.unique_id().unwrap()[..], &id(5)[..]);
    // A rank making a new set beside a grow, a grow without newcomers or members, and
    // members whose ranks are not 0..members are refused on every rank.
    let refused = [
        vec![h(member(0), vec![id(1)]), h(Role::New, vec![])],
        vec![h(member(0), vec![id(1)]), h(member(1), vec![])],
        vec![h(Role::Newcomer, vec![]), h(Role::Newcomer, vec![])],
        vec![
            h(member(0), vec![id(1)]),
            h(member(2), vec![]),
            h(Role::Newcomer, vec![]),
        ],
        vec![
            h(member(1), vec![id(1)]),
            h(member(1), vec![]),
            h(Role::Newcomer, vec![]),
        ],
    ];
    for hellos in refused {
        let roles: Vec<_> = hellos.iter().map(|h| h.role).collect();
        assert!(
            matches!(settle(&hellos), Err(Error::Protocol { .. })),
            "{roles:?}"
        );
    }
    // No unique id (a root that sent none), or two, is refused once read.
    let none = settle(&[h(member(0), vec![]), h(Role::Newcomer, vec![])]).unwrap();
    assert!(matches!(none.unique_id(), Err(Error::Protocol { .. })));
    // A new set has no grow.
    assert_eq!(settle(&[h(Role::New, vec![id(1)])]).unwrap().grow, None);
}

#[test]
fn node_identity_follows_nccl() {
    let none = |_: &str| None;
    assert_eq!(node_identity(&none, "gpu01\n", Some("abc\n")), "gpu01/abc");
    assert_eq!(node_identity(&none, "gpu01", None), "gpu01");
    let hostid = |k: &str| (k == "NCCL_HOSTID").then(|| "rack7".to_string());
    assert_eq!(node_identity(&hostid, "gpu01", Some("abc")), "hostid:rack7");
    let empty = |k: &str| (k == "NCCL_HOSTID").then(String::new);
    assert_eq!(node_identity(&empty, "gpu01", Some("abc")), "gpu01/abc");
    // Same host name on two hosts (containers): the boot id tells them apart.
    let a = node_identity(&none, "worker", Some("boot-a"));
    let b = node_identity(&none, "worker", Some("boot-b"));
    assert_eq!(count_nodes([a.as_str(), b.as_str(), a.as_str()]), 2);
    assert_eq!(count_nodes(std::iter::empty()), 1);
    assert!(!this_node().is_empty());
}

#[test]
fn ranks_on_one_gpu_are_told_apart_by_its_uuid() {
    let (a, b) = (vec![1u8; 16], vec![2u8; 16]);
    assert!(!shared_devices([a.as_slice(), b.as_slice()]));
    assert!(shared_devices([a.as_slice(), b.as_slice(), a.as_slice()]));
    // Unknown (empty) identities never match.
    assert!(!shared_devices([&[][..], &[][..]]));
    assert!(!shared_devices(std::iter::empty()));
}
