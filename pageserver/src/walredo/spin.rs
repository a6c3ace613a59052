//! The manager's handle on the spin window of its child (see `Process::set_spin` and the
//! protocol's `S` frame): how long the child, and the sync kind's reader, busy-poll between
//! requests before they block.
//!
//! The pool's controller loop sets every child's window each period ([`WalRedoManager::set_spin_of`]
//! from `apply_spin`); [`WalRedoManager::set_spin`] is for tests and benchmarks. A new
//! child starts with a window of 0 (it blocks at once), whatever the last child had.

use std::time::Duration;

use std::sync::Arc;

use super::pipeline::ProcessError;
use super::process::Process;
use super::{RedoError, WalRedoManager};

impl WalRedoManager {
    /// Sets the spin window of the oldest child in service (the one `status().process` shows), cut to 1 ms (`MAX_SPIN_US`); zero parks
    /// it (blocking waits, as at start). Returns the child's pid, or `None` when no child runs
    /// (nothing is spawned for this). The window shows in [`WalRedoManager::status`] as
    /// `process.spin_us`. Setting the window the child holds already sends nothing, and
    /// setting it does not count as use of the child: a controller may repeat its decision
    /// every period without keeping an idle child from its idle stop.
    ///
    /// Errors: [`RedoError::ProcessFailed`] when the child does not announce the `S` frame in
    /// its hello (it is left in service) or when the round trip failed (the child is retired,
    /// as after a failed request); [`RedoError::Timeout`] and [`RedoError::QueueTimeout`] as
    /// for a request.
    ///
    /// Cancel-safe: dropping it never hands its reply to a request; dropped after the frame
    /// was written, the child may hold the new window while the status shows the old one,
    /// until the next call.
    pub async fn set_spin(&self, window: Duration) -> Result<Option<u32>, RedoError> {
        if self.cancel.is_cancelled() {
            return Err(RedoError::ShuttingDown);
        }
        let _in_flight = self.in_flight.token();
        // Not `take_current`: that counts as use. An idle stop meanwhile is graceful (the child
        // lives until this reference goes), so the round trip still completes.
        let Some(process) =
            crate::util::lock(&self.pool).children().iter().find(|p| !p.has_exited()).cloned()
        else {
            return Ok(None);
        };
        self.set_spin_of(&process, window).await.map(|()| Some(process.pid))
    }

    /// Sets the spin window of `process` (see [`WalRedoManager::set_spin`]); a failed round
    /// trip retires it, as after a failed request.
    pub(crate) async fn set_spin_of(
        &self,
        process: &Arc<Process>,
        window: Duration,
    ) -> Result<(), RedoError> {
        match process.set_spin(window, self.conf.patience()).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(RedoError::ProcessFailed(anyhow::anyhow!(
                "walredo process {} does not announce spin windows in its hello",
                process.pid
            ))),
            // The child is working, only busy: it stays in service.
            Err(ProcessError::QueueTimeout(t)) => Err(RedoError::QueueTimeout(t)),
            Err(e) => {
                self.retire(process, e.stop_cause());
                Err(RedoError::of_process(
                    e,
                    format!("set the spin window of walredo process {}", process.pid),
                ))
            }
        }
    }
}
