//! Volley's benchmarks: the TPC-H / SSB runner and kernel micro-benchmarks.
//!
//! Nothing is measured here yet (see DESIGN.md §9: benchmarks report ratios measured in
//! one run, and are not tests).
