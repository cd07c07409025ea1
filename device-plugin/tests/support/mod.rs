pub mod kubelet_harness;
