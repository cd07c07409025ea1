pub use kubelet_harness;
