//! Streaming building blocks that are not tied to Kafka: event-time window table functions
//! (`TUMBLE`, `HOP`, `SESSION`) and the scope a continuous query runs its ticks in.
//!
//! The window functions work on any table, so a windowed aggregation over a live table can
//! be checked against the same SQL over a plain table. A continuous query (see the
//! `fulmen-connectors` crate) runs its SQL once per tick in a session whose config carries a
//! [`StreamScope`]: the window functions then emit only the windows that closed since the
//! previous tick, and note the windows they used so that the query knows how far back its
//! open windows reach.

pub mod window;

use std::sync::Mutex;

pub use window::{
    WindowKind, fixed_window_columns, fixed_window_over, hop_panes, register_window_functions,
    session_key,
};

/// What a continuous query's tick allows its window functions to emit, and what they report
/// back. Put into a session with `SessionConfig::set_extension`.
#[derive(Debug, Default)]
pub struct StreamScope {
    /// Windows whose end is at or before this instant (nanoseconds since the epoch) were
    /// emitted by an earlier tick.
    pub emitted_up_to: Option<i64>,
    /// Emit only windows whose end is at or before this instant (the watermark).
    pub emit_up_to: Option<i64>,
    used: Mutex<Vec<WindowKind>>,
}

impl StreamScope {
    /// A scope emitting the windows that end in `(emitted_up_to, emit_up_to]`.
    pub fn new(emitted_up_to: Option<i64>, emit_up_to: Option<i64>) -> Self {
        Self {
            emitted_up_to,
            emit_up_to,
            used: Mutex::new(Vec::new()),
        }
    }

    /// The window functions the query's plan used (recorded when they were planned).
    pub fn windows_used(&self) -> Vec<WindowKind> {
        self.used.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn note(&self, kind: WindowKind) {
        self.used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(kind);
    }
}
