"""`rollout.policy.TeamPolicy`: requests go to their agent's group, handles back to
the group whose engine made them."""

import numpy as np

from mtrl_jax.rollout.policy import TeamHandle, TeamPolicy
from mtrl_jax.sampling.slots import Request
from mtrl_jax.testing import FakePolicy


def _request(tag, agent, parent=None):
  return Request(tag, np.arange(1, 4), np.zeros(2, np.uint32), np.arange(2), agent, parent)


def test_a_handle_goes_back_to_the_group_whose_engine_made_it():
  groups = [FakePolicy(separate=True), FakePolicy(separate=True)]
  team = TeamPolicy(groups, [(1,), (0, 2)])
  team.start(2)
  for a in range(3):
    team.submit(_request(a, a))
  samples, _ = team.step()
  assert {s.tag: s.handle.group for s in samples} == {0: 1, 1: 0, 2: 1}
  assert all(isinstance(s.handle, TeamHandle) for s in samples)
  # Each group's engine saw its own agents' requests under their index in the group.
  assert [r.agent for r in groups[0].requests] == [0]
  assert [r.agent for r in groups[1].requests] == [0, 1]
  # A request naming a cache hands its group's engine that engine's own handle.
  first = next(s for s in samples if s.tag == 2)
  team.submit(_request("again", 2, parent=first.handle))
  assert groups[1].requests[-1].parent is first.handle.handle
  for s in samples:
    team.release(s.handle)
  assert [g.released for g in groups] == [2, 4]
  assert all(s.handle.handle.released for s in samples)
