"""The EngineCore's decision in a two-phase commit across tensor-parallel ranks (vllm_patches/update_enginecore.py),
as pure functions of what each rank answered; the real TP=2 engine with a fault on one rank is
test_tensor_parallel_faults.py."""

from __future__ import annotations

from vllm_patches.rpc import CommitApplied, RankCommit, RankSettled
from vllm_patches.update_enginecore import RANKS_SPLIT, commit_verdict, settle_verdict


def applied(rank: int) -> RankCommit:
    return RankCommit(rank, applied=CommitApplied(3, 0.01, 2))


def test_a_commit_stands_only_when_every_rank_applied_it_and_kept_it():
    ranks = [applied(0), applied(1)]
    assert commit_verdict(ranks)
    assert settle_verdict(3, ranks, [RankSettled(0, "kept"), RankSettled(1, "kept")]) is None


def test_one_rank_that_failed_rolls_every_rank_back_and_says_all_hold_their_previous_weights():
    ranks = [applied(0), RankCommit(1, error="injected fault")]
    assert not commit_verdict(ranks)
    error = settle_verdict(3, ranks, [RankSettled(0, "rolled back"), RankSettled(1, "nothing")])
    assert "rank 1: injected fault" in error and "every rank holds its previous weights again" in error
    assert RANKS_SPLIT not in error


def test_a_rollback_that_fails_on_any_rank_is_a_split_that_stops_the_engine():
    ranks = [applied(0), RankCommit(1, error="out of memory")]
    error = settle_verdict(3, ranks, [RankSettled(0, "failed", "disk gone"), RankSettled(1, "nothing")])
    assert RANKS_SPLIT in error and "rank 0 (disk gone)" in error
    own = [applied(0), RankCommit(1, error="half-way", restored=False)]
    assert RANKS_SPLIT in settle_verdict(3, own, [RankSettled(0, "rolled back"), RankSettled(1, "nothing")])


def test_no_ranks_at_all_is_never_a_commit():
    assert not commit_verdict([])
