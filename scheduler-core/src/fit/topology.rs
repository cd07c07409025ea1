//! The topology-aware choice (contract §5.3): when more devices passed Fit than the container needs, the
//! set whose pairwise scores from `hami.io/node-nvidia-score` are best.

use super::capacity::{GpuState, NodeState};
use super::container::Pick;

/// The topology score between GPUs `a` and `b` of `gpus` (0 when the node has none for them).
fn pair_score(node: &NodeState, gpus: &[GpuState], a: usize, b: usize) -> i64 {
    node.topology
        .as_ref()
        .and_then(|t| t.get(&gpus[a].uuid))
        .and_then(|m| m.get(&gpus[b].uuid))
        .copied()
        .unwrap_or(0)
}

/// The topology-aware choice among more candidates than needed (contract §5.3, after the loop).
pub(super) fn pick_by_topology(
    node: &NodeState,
    gpus: &[GpuState],
    collected: Vec<Pick>,
    nums: usize,
) -> Vec<Pick> {
    if nums == 1 {
        let mut best: Option<(i64, usize)> = None;
        for (i, p) in collected.iter().enumerate() {
            let sum: i64 = collected
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, q)| pair_score(node, gpus, p.gpu, q.gpu))
                .sum();
            if best.is_none_or(|(s, _)| sum < s) {
                best = Some((sum, i));
            }
        }
        let i = best.map_or(0, |(_, i)| i);
        return vec![collected[i].clone()];
    }
    // Lexicographic combinations over collection order; the first maximum wins.
    let n = collected.len();
    let mut idx: Vec<usize> = (0..nums).collect();
    let mut best: Option<(i64, Vec<usize>)> = None;
    loop {
        let mut sum = 0i64;
        for x in 0..nums {
            for y in (x + 1)..nums {
                sum += pair_score(node, gpus, collected[idx[x]].gpu, collected[idx[y]].gpu);
            }
        }
        if best.as_ref().is_none_or(|(s, _)| sum > *s) {
            best = Some((sum, idx.clone()));
        }
        // Next combination.
        let mut k = nums;
        loop {
            if k == 0 {
                let chosen = best.map(|(_, v)| v).unwrap_or_default();
                return chosen.into_iter().map(|i| collected[i].clone()).collect();
            }
            k -= 1;
            if idx[k] != k + n - nums {
                break;
            }
        }
        idx[k] += 1;
        for j in (k + 1)..nums {
            idx[j] = idx[j - 1] + 1;
        }
    }
}
