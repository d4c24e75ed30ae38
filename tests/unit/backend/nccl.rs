use super::build::context;
use super::*;
use crate::control::{Exchange, LocalExchange};

#[test]
fn no_driver_is_an_error_not_a_panic() {
    // On a machine without a driver every entry point returns LibraryUnavailable; on
    // a GPU machine they may succeed. Either way nothing panics.
    if ffi::driver_present() {
        return;
    }
    assert!(matches!(
        device_count(),
        Err(Error::LibraryUnavailable { .. })
    ));
    assert!(matches!(
        nccl_version(),
        Err(Error::LibraryUnavailable { .. })
    ));
    assert!(matches!(context(0), Err(Error::LibraryUnavailable { .. })));
    let ex: Arc<dyn Exchange> = Arc::new(LocalExchange::group(1).remove(0));
    assert!(matches!(
        NcclBackend::from_env(ex.clone(), NcclConfig::default()),
        Err(Error::LibraryUnavailable { .. })
    ));
    assert!(matches!(
        NcclBackend::local_world(&[0], NcclConfig::default()),
        Err(Error::LibraryUnavailable { .. })
    ));
    // SAFETY: fails before the handle is looked at (no driver).
    let adopted = unsafe { NcclBackend::adopt(std::ptr::null_mut(), 0, ex, NcclConfig::default()) };
    assert!(matches!(adopted, Err(Error::LibraryUnavailable { .. })));
}
