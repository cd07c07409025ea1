//! The scheduler extender's decision logic, with no I/O.
