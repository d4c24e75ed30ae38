use super::*;
use crate::control::Launch;

#[test]
fn the_server_polls_only_where_the_ranks_leave_it_cores() {
    let spin = Duration::from_micros(40);
    let config = |world: usize, server_spin: Option<Duration>| {
        let mut c = StoreConfig::new(Launch::explicit(0, world, "127.0.0.1", 1).unwrap());
        c.spin = spin;
        c.server_spin = server_spin;
        c
    };
    // Default: the client's spin where world <= cores / 2.
    assert_eq!(server_spin_in_effect(&config(8, None), 16), spin);
    assert_eq!(server_spin_in_effect(&config(8, None), 17), spin);
    assert_eq!(server_spin_in_effect(&config(9, None), 16), Duration::ZERO);
    assert_eq!(server_spin_in_effect(&config(1, None), 1), Duration::ZERO);
    assert_eq!(server_spin_in_effect(&config(2, None), 2), Duration::ZERO);
    // An explicit setting wins either way.
    let set = Duration::from_micros(7);
    assert_eq!(server_spin_in_effect(&config(64, Some(set)), 2), set);
    assert_eq!(
        server_spin_in_effect(&config(2, Some(Duration::ZERO)), 64),
        Duration::ZERO
    );
}
