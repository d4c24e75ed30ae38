//! Fuzz target for the store's frame decoder: arbitrary bytes as a peer of the TCP
//! store would send them (a preface, then length-prefixed frames), read with short
//! reads of a size the input picks, against a frame limit the input picks.
//!
//! Checked (by `symmpool::control::fuzzing::fuzz_frames`): no panic; a frame length
//! over the limit is refused before the buffer grows past it; a preface is accepted
//! exactly when its magic and version are this build's; every frame that decodes (as
//! a client's or as a server's message) encodes back to one that decodes to the same
//! message.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    symmpool::control::fuzzing::fuzz_frames(data);
});
