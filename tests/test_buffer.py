"""The replay buffer: capacity bound and off-policy staleness eviction."""

from forge_core.actors.replay_buffer import ReplayBuffer
from forge_core.episode import Episode, collate


def ep(version, i=0, n_resp=3):
    return Episode(prompt_id=f"p{i}", group=0, target="1", prompt_ids=[1, 2], response_ids=list(range(5, 5 + n_resp)),
                   behaviour_logprobs=[-0.5] * n_resp, text="", policy_version=version)


def test_staleness_bound_evicts_old_episodes():
    b = ReplayBuffer(capacity=100, max_staleness=1)
    b.add([ep(0, i) for i in range(4)] + [ep(1, i) for i in range(4)])
    assert b.sample(4, step=1) is not None  # versions 0 usable at step 1 (staleness 1)
    got = b.sample(4, step=2)  # remaining: version 1 only; version-0 would be staleness 2
    assert [e.policy_version for e in got] == [1, 1, 1, 1]
    b.add([ep(0, 9)])
    assert b.sample(1, step=2) is None  # the stale episode is evicted, not returned
    assert b.stats()["evicted_stale"] == 1 and len(b) == 0


def test_on_policy_bound_zero():
    b = ReplayBuffer(capacity=10, max_staleness=0)
    b.add([ep(2), ep(3)])
    assert [e.policy_version for e in b.sample(1, step=3)] == [3]


def test_capacity_evicts_oldest_first():
    b = ReplayBuffer(capacity=3, max_staleness=5)
    b.add([ep(0, i) for i in range(5)])
    assert len(b) == 3 and b.stats()["evicted_capacity"] == 2
    assert [e.prompt_id for e in b.sample(3, step=0)] == ["p2", "p3", "p4"]


def test_sample_waits_for_enough():
    b = ReplayBuffer(capacity=10, max_staleness=1)
    b.add([ep(0)])
    assert b.sample(2, step=0) is None and len(b) == 1


def test_collate_layout():
    e1, e2 = ep(0, n_resp=2), ep(0, n_resp=4)
    e2.prompt_ids = [7, 8, 9]
    e1.advantage, e2.advantage = 1.0, -1.0
    b = collate([e1, e2], pad_id=0, pad_to=8)
    assert b.input_ids.shape == (2, 16) and b.prompt_len == 8
    assert b.input_ids[1, 5:8].tolist() == [7, 8, 9] and b.attention_mask[0, :6].sum() == 0  # left-padded prompts
    assert b.response_mask.sum(-1).tolist() == [2, 4] and b.advantages.tolist() == [1.0, -1.0]
    assert b.ref_logprobs is None


def test_reward_and_buffer_processes_import_no_torch():
    """The reward and replay-buffer actors (and the Placement actor beside every service) hold plain
    lists: their processes import their modules alone; loading torch there cost each 2.3-2.9 s of CPU
    (AMD EPYC, 2 cores) at start-up."""
    import subprocess
    import sys

    code = ("import sys, forge_core.actors.reward, forge_core.actors.replay_buffer, forge_core.actors.placement; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
