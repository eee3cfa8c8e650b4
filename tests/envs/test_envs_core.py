"""Turn, Thread, Environment defaults, forking, and the factory registry."""

import copy
import sys
import textwrap

import pytest

from mtrl_jax.envs import (
    Environment,
    EnvironmentFactory,
    SharedResource,
    Thread,
    ToolSet,
    Turn,
    register_env_factory,
    registered_env_factories,
    resolve_factory,
    tool,
)
from mtrl_jax.tasks.weather import WeatherEnv, WeatherFactory


def test_turn_validation_and_immutability():
  t = Turn("tool", "42", name="calc", metadata={"ok": True})
  assert t.to_dict() == {"role": "tool", "content": "42", "name": "calc", "metadata": {"ok": True}}
  with pytest.raises(ValueError, match=r"Turn.role='robot'; allowed: \['system', 'user'"):
    Turn("robot", "x")
  with pytest.raises(TypeError, match="content must be str"):
    Turn("user", 3)
  with pytest.raises(TypeError):
    t.metadata["ok"] = False  # read-only view
  assert copy.deepcopy(t) is t


def test_thread_append_is_persistent():
  a = Thread.from_messages([("system", "s"), {"role": "user", "content": "q"}], {"k": 1})
  b = a.append(Turn("assistant", "x"), Turn("tool", "y", name="t"))
  assert len(a) == 2 and len(b) == 4
  assert b.last().content == "y" and b.last("user").content == "q"
  assert b.last_assistant == "x" and a.last_assistant == ""
  assert b.count("assistant") == 1 and b.metadata == {"k": 1}
  c = b.with_metadata(k=2, j=3)
  assert c.metadata == {"k": 2, "j": 3} and b.metadata == {"k": 1}
  with pytest.raises(TypeError, match=r"Thread.turns\[0\] must be a Turn"):
    Thread(("user", "x"))


def test_thread_fork_copies_ledger_only(renderer):
  thread = Thread.from_messages([("user", "hi")])
  ledger = renderer.render_conversation(thread.turns)
  thread = thread.replace(ledger=ledger)
  assert thread.num_rendered == 1
  child = thread.fork()
  renderer.render_turn(child.ledger, Turn("assistant", "yo"))
  assert child.num_rendered == 2 and thread.num_rendered == 1
  assert len(thread.ledger) < len(child.ledger)


def test_default_initial_thread_includes_tool_schemas():
  @tool
  def ping() -> str:
    """Pings."""
    return "pong"

  env = Environment({"prompt": "go"}, tools=ToolSet([ping]), system="Be kind.")
  t = env.initial_thread()
  assert [x.role for x in t.turns] == ["system", "user"]
  assert t.turns[0].content.startswith("Be kind.\n") and '"name":"ping"' in t.turns[0].content
  assert t.turns[1].content == "go" and t.metadata == {"prompt": "go"}
  msgs = Environment({"messages": [{"role": "user", "content": "a"}]}).initial_thread()
  assert [x.content for x in msgs.turns] == ["a"]
  with pytest.raises(ValueError, match="metadata needs 'prompt' or 'messages'"):
    Environment({"x": 1}).initial_thread()
  with pytest.raises(NotImplementedError, match="must implement react_to"):
    Environment({"prompt": "x"}).react_to(t)


class _Judge(SharedResource):
  pass


class _Counting(Environment):

  def __init__(self, metadata):
    super().__init__(metadata)
    self.history = []
    self.judge = _Judge()

  def react_to(self, thread):
    self.history.append(thread.last_assistant)
    return None, 1.0


def test_fork_deep_copies_state_but_shares_resources():
  env = _Counting({"prompt": "x"})
  env.react_to(env.initial_thread().append(Turn("assistant", "a")))
  child = env.fork()
  child.history.append("b")
  assert env.history == ["a"] and child.history == ["a", "b"]
  assert child.judge is env.judge  # SharedResource: not copied


def test_fork_override_hook():
  class External(Environment):
    opened = 0

    def __init__(self, metadata):
      super().__init__(metadata)
      External.opened += 1
      self.handle = External.opened

    def fork(self):  # e.g. a container: open a fresh one instead of copying
      return External(self.metadata)

  env = External({})
  assert env.fork().handle == env.handle + 1


def test_react_to_joint_default_and_errors():
  env = _Counting({"prompt": "x"})
  t = env.initial_thread().append(Turn("assistant", "a"))
  assert env.react_to_joint([t]) == (None, 1.0)
  with pytest.raises(NotImplementedError, match="2 agent threads"):
    env.react_to_joint([t, t])


def test_faults_reported_by_env_are_drained():
  env = Environment({})
  env.report_fault("model_format", "no answer tag")
  (f,) = env.drain_faults()
  assert f.kind.value == "model_format" and f.source == "environment"
  assert env.drain_faults() == []
  with pytest.raises(ValueError, match="fault kind 'oops'; allowed"):
    env.report_fault("oops", "x")


def test_registry_and_resolution_by_name():
  factory = resolve_factory("weather")  # registered when the examples are imported
  assert "weather" in registered_env_factories()
  assert isinstance(factory, WeatherFactory)
  env = factory.create_environment({"city": "oslo"})
  assert isinstance(env, WeatherEnv)
  assert env is not factory.create_environment({"city": "oslo"})  # fresh per trajectory
  with pytest.raises(ValueError, match=r"unknown environment factory 'nope'; registered: \["):
    resolve_factory("nope")


def test_register_conflicts_and_bad_names():
  @register_env_factory("test-core-dummy")
  class Dummy(EnvironmentFactory):

    def __init__(self, scale=1):
      self.scale = scale

    def create_environment(self, metadata):
      return _Counting(metadata)

  assert resolve_factory("test-core-dummy", scale=3).scale == 3
  with pytest.raises(ValueError, match="already registered"):
    register_env_factory("test-core-dummy")(WeatherFactory)
  with pytest.raises(ValueError, match="without ':'"):
    register_env_factory("a:b")


def test_resolution_by_import_path(tmp_path, monkeypatch):
  pkg = tmp_path / "my_pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "my_env.py").write_text(textwrap.dedent("""
      from mtrl_jax.envs import Environment, EnvironmentFactory

      class MyEnv(Environment):
        def react_to(self, thread):
          return None, {"done": 1.0}

      class MyFactory(EnvironmentFactory):
        def create_environment(self, metadata):
          return MyEnv(metadata)

      def make(metadata):
        return MyEnv(metadata)

      INSTANCE = MyFactory()
      NOT_A_FACTORY = 3
  """))
  monkeypatch.syspath_prepend(str(tmp_path))
  try:
    for spec in (
        "my_pkg.my_env:MyFactory",
        "my_pkg.my_env:make",
        "my_pkg.my_env:INSTANCE",
        "my_pkg.my_env:MyEnv",
    ):
      env = resolve_factory(spec).create_environment({"prompt": "p"})
      assert type(env).__name__ == "MyEnv" and env.metadata == {"prompt": "p"}
    with pytest.raises(ValueError, match="has no 'Missing'"):
      resolve_factory("my_pkg.my_env:Missing")
    with pytest.raises(ValueError, match="cannot import 'my_pkg.nope'"):
      resolve_factory("my_pkg.nope:X")
    with pytest.raises(TypeError, match="neither an EnvironmentFactory"):
      resolve_factory("my_pkg.my_env:NOT_A_FACTORY")
  finally:
    for m in [m for m in sys.modules if m.startswith("my_pkg")]:
      del sys.modules[m]


class _Stateful(Environment):
  """A per-environment tool: a bound method over the environment's own state."""

  def __init__(self, metadata):
    super().__init__(metadata)
    self.db = {"a": 1}
    self.tools = ToolSet([tool(self.lookup)])

  def lookup(self, key: str) -> str:
    """Reads the environment's database.

    Args:
      key: the key.
    """
    return str(self.db[key])

  def react_to(self, thread):
    return self.run_tools(thread), None


def test_fork_rebinds_method_tools_to_the_copy():
  env = _Stateful({"prompt": "x"})
  child = env.fork()
  child.db["a"] = 2
  call = '<tool_call>{"name":"lookup","arguments":{"key":"a"}}</tool_call>'
  thread = env.initial_thread().append(Turn("assistant", call))
  assert env.react_to(thread)[0].last().content == "1"
  assert child.react_to(thread)[0].last().content == "2"
  assert env.tools["lookup"].parameters["required"] == ["key"]  # `self` is not an argument
