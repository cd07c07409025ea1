//! `CUDA_VISIBLE_DEVICES`: maps an NVML index (inside the container) to the CUDA ordinal that
//! the region is indexed by. A numeric list `a,b,c` makes NVML index `b` CUDA ordinal 1; an unset
//! variable, UUIDs or `MIG-…` entries give the identity map (the Kubernetes case, where the
//! container sees only its own GPUs).

use std::sync::OnceLock;

fn parse(v: Option<&str>) -> Option<Vec<usize>> {
    let v = v?.trim();
    if v.is_empty() {
        return None;
    }
    v.split(',')
        .map(|f| f.trim().parse::<usize>().ok())
        .collect()
}

fn map() -> &'static Option<Vec<usize>> {
    static MAP: OnceLock<Option<Vec<usize>>> = OnceLock::new();
    MAP.get_or_init(|| parse(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref()))
}

pub fn nvml_to_cuda_in(list: &Option<Vec<usize>>, nvml: usize) -> Option<usize> {
    match list {
        None => (nvml < vgpu_region::MAX_DEVICES).then_some(nvml),
        Some(l) => l.iter().position(|&i| i == nvml),
    }
}

pub fn cuda_to_nvml_in(list: &Option<Vec<usize>>, cuda: usize) -> Option<usize> {
    match list {
        None => Some(cuda),
        Some(l) => l.get(cuda).copied(),
    }
}

pub fn nvml_to_cuda(nvml: usize) -> Option<usize> {
    nvml_to_cuda_in(map(), nvml)
}

pub fn cuda_to_nvml(cuda: usize) -> Option<usize> {
    cuda_to_nvml_in(map(), cuda)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_numeric_lists_and_falls_back_to_identity() {
        let l = parse(Some("1,0"));
        assert_eq!(nvml_to_cuda_in(&l, 1), Some(0));
        assert_eq!(nvml_to_cuda_in(&l, 0), Some(1));
        assert_eq!(nvml_to_cuda_in(&l, 2), None);
        assert_eq!(cuda_to_nvml_in(&l, 0), Some(1));
        let id = parse(Some("GPU-1234,GPU-5678"));
        assert_eq!(id, None);
        assert_eq!(nvml_to_cuda_in(&id, 3), Some(3));
        assert_eq!(parse(None), None);
        assert_eq!(parse(Some("")), None);
    }
}
