"""The run's console lines (`run.console`): their formats from hand-written values,
the compile progress through `shapes.precompile`, and the phase lines of the shared
smoke run (`smoke_run`, its stderr)."""

import io
import re
import threading
import time
import types

from mtrl_jax.run import console as console_lib
from mtrl_jax.run.console import Console


def _sft(**kw):
  fields = dict(
      steps=200, batch_size=8, num_examples=64, until_success=0.3, check_tasks=100, check_every=25
  )
  return types.SimpleNamespace(**{**fields, **kw})


def test_durations_read_as_seconds_minutes_and_hours():
  assert [console_lib.duration(s) for s in (0.4, 41, 492, 3780)] == [
      "0 s",
      "41 s",
      "8 min 12 s",
      "1 h 3 min",
  ]


def test_sft_lines_name_the_stop_rule_progress_and_why_it_ended():
  assert console_lib.format_sft_start(_sft()) == (
      "sft: up to 200 steps of 8 rows from 64 golden conversations; stops early once greedy "
      "success on 100 held-back train tasks reaches 0.3 (checked every 25 steps)"
  )
  assert console_lib.format_sft_start(_sft(until_success=0.0)).endswith("; no early stop")
  row = {"sft_step": 25, "nll": 1.2041, "check_success": 0.125}
  assert console_lib.format_sft_row(row, 200, 14.2) == (
      "sft: step 25/200 nll 1.204 check_success 0.12 (14 s)"
  )
  stopped = [row, {"sft_step": 75, "nll": 0.8, "check_success": 0.31}]
  assert console_lib.format_sft_end(stopped, 200, 0.3, 41) == (
      "sft: stopped at step 75 of 200: check_success 0.31 >= 0.3 (41 s)"
  )
  ran = [{"sft_step": 200, "nll": 0.5, "check_success": 0.25}]
  assert console_lib.format_sft_end(ran, 200, 0.3, 75) == (
      "sft: done, 200 steps in 1 min 15 s, nll 0.500, check_success 0.25 (< 0.3)"
  )
  assert console_lib.format_sft_end([{"sft_step": 3, "nll": 2.0}], 3, 0.0, 5) == (
      "sft: done, 3 steps in 5 s, nll 2.000"
  )


def test_sft_progress_prints_a_line_per_tenth_of_the_steps():
  out, clock = io.StringIO(), iter(range(100))
  c = Console(True, stream=out, clock=lambda: next(clock))
  c.sft_start(_sft(steps=100, check_every=5))
  for i in range(5, 101, 5):
    c.sft_row({"sft_step": i, "nll": 1.0}, 100)
  steps = [int(re.search(r"step (\d+)/", l).group(1)) for l in out.getvalue().splitlines()[1:]]
  assert steps == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]


def test_compile_progress_lines_start_finish_and_throttle():
  out, now = io.StringIO(), [0.0]
  c = Console(True, stream=out, clock=lambda: now[0], every_s=15)
  c.compiled("train-step", 0, 18)
  for done in range(1, 19):
    now[0] += 6.0
    c.compiled("train-step", done, 18)
  lines = out.getvalue().splitlines()
  assert lines[0] == "compiling 18 train-step programs"
  assert lines[1] == "compiled 3/18 train-step programs (18 s)"  # 15 s or more apart
  assert lines[-1] == "compiled 18/18 train-step programs (1 min 48 s)"
  assert len(lines) == 7  # 3, 6, ..., 18


def test_eval_lines_show_each_mode_and_the_best_so_far():
  out = io.StringIO()
  c = Console(True, history=[{"step": 0, "eval/greedy/success": 0.25}], stream=out)
  m = {
      "eval/greedy/success": 0.5,
      "eval/greedy/return": -0.125,
      "eval/greedy/turns": 3.14,
      "eval/greedy/outcome": 0.1,
      "eval/sampled/success": 0.75,
      "eval/sampled/return": 0.5,
      "eval/sampled/turns": 2.0,
  }
  c.evaluated(10, m)
  c.evaluated(20, {**m, "eval/greedy/success": 0.5})  # a tie keeps the earlier best
  lines = out.getvalue().splitlines()
  assert lines[0] == (
      "eval at step 10: greedy success 0.50 return -0.12 turns 3.1; sampled "
      "success 0.75 return 0.50 turns 2.0 | best success 0.50 at step 10"
  )
  assert lines[1].endswith("| best success 0.50 at step 10")
  c.evaluated(30, {})  # nothing evaluated (eval.num_tasks=0): no line
  assert len(out.getvalue().splitlines()) == 2


def test_postfix_names_what_the_bar_shows():
  assert console_lib.format_postfix({"rollout/return": 0.4567, "rollout/path_success": 0.5}) == {
      "root_return": "0.46",
      "train_success": "0.50",
  }
  assert console_lib.format_postfix({}) == {"root_return": "n/a", "train_success": "n/a"}


def test_the_bar_shows_its_labels_and_lines_go_above_it(capsys):
  c = Console(True)
  c.open_bar(2, 0, progress=True)
  c.step_done({"rollout/return": 0.5, "rollout/path_success": 0.25})
  c.say("eval at step 1: ...")
  c.close_bar()
  err = capsys.readouterr().err
  assert "root_return=0.50" in err and "train_success=0.25" in err, err
  assert "eval at step 1: ...\n" in err and c.bar is None
  quiet = Console(True)
  quiet.open_bar(2, 0, progress=False)  # --progress=false: no bar, the lines stay
  quiet.step_done({})
  quiet.say("done: ...")
  assert quiet.bar is None and capsys.readouterr().err == "done: ...\n"


def test_start_and_end_lines():
  assert console_lib.format_rl_start(1, 130, 10, True) == (
      "rl: steps 1-130, held-out evaluation every 10 steps"
  )
  assert console_lib.format_rl_start(4, 3, 2, False) == "rl: nothing left to run (step 3 of 3 done)"
  assert console_lib.format_end(1, 130, 492, (0.8, 120), "/runs/a") == (
      "done: 130 RL steps (1-130) in 8 min 12 s; best eval success 0.80 at step 120; files in "
      "/runs/a (summary.json, metrics.jsonl, curves.png, ckpt/, best/)"
  )
  assert console_lib.format_end(1, 7, 30, None, "/r", halted=True).startswith(
      "done: 7 RL steps (1-7) in 30 s, halted at step 7; files in /r"
  )
  assert console_lib.format_end(4, 3, 2, None, "/r").startswith("done: no RL step run in 2 s")


def test_a_process_that_does_not_write_says_nothing(capsys):
  c = Console(False)
  c.say("x")
  c.evaluated(0, {"eval/greedy/success": 1.0})
  c.open_bar(3, 0, progress=True)
  assert c.bar is None and capsys.readouterr() == ("", "")


class _PieceByPiece(io.StringIO):
  """A stream that hands the interpreter to other threads inside each write."""

  def write(self, text):
    for ch in text:
      super().write(ch)
      time.sleep(0)
    return len(text)


def test_lines_said_from_two_threads_stay_whole():
  """The train-step programs report from a thread of their own while the warm-up's
  lines print (`shapes.TrainCompile`): each line comes out whole."""
  out = _PieceByPiece()
  c = Console(True, stream=out)
  said = lambda who: [c.say(f"{who} line {i}") for i in range(40)]
  threads = [threading.Thread(target=said, args=(w,)) for w in ("compile", "sft")]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  lines = out.getvalue().splitlines()
  expected = {f"{w} line {i}" for w in ("compile", "sft") for i in range(40)}
  assert len(lines) == 80 and set(lines) == expected


def test_precompile_reports_each_engine_and_train_step_program():
  from mtrl_jax.run import experiment, shapes
  from tests.train.test_rl_loop import smoke_config

  class Engine:

    def precompile(self, params, samplings, num_stop_ids, fanout, threads, progress):
      for done in range(3):
        progress(done, 2)
      return 2

  class Step:

    def lower(self, spec):
      return []  # nothing to compile

  plan = shapes.plan_shapes(experiment.build(smoke_config()), row_multiple=2, local_shards=2)
  calls = []
  info = shapes.precompile(
      plan, [(Engine(), "params", 1)], [Step()], progress=lambda *a: calls.append(a)
  )
  n = len(plan.train_specs())
  assert calls == (
      [("engine", d, 2) for d in range(3)] + [("train-step", d, n) for d in range(n + 1)]
  )
  assert info["train_programs"] == n


def test_the_smoke_run_says_each_phase(smoke_run):
  lines = smoke_run.console().splitlines()
  ours = [l for l in lines if l.startswith(("sft:", "eval at", "rl:", "done:"))]
  kinds = [re.match(r"(sft: \w+|eval at step \d+|rl:|done:)", l).group(1) for l in ours]
  assert kinds[2] in ("sft: done", "sft: stopped"), lines
  assert kinds[:2] + kinds[3:] == [
      "sft: up",
      "sft: step",
      "eval at step 0",
      "rl:",
      "eval at step 2",
      "eval at step 3",
      "done:",
  ], lines
  assert ours[0].startswith(
      "sft: up to 3 steps of 8 rows from 16 golden conversations; "
      "stops early once greedy success on 4 held-back train tasks"
  )
  assert ours[2].startswith(("sft: done, 3 steps", "sft: stopped at step")), ours[2]
  assert re.fullmatch(
      r"eval at step 0: greedy success \d\.\d\d return -?\d\.\d\d turns "
      r"\d\.\d \| best success \d\.\d\d at step 0",
      ours[3],
  ), ours[3]
  assert ours[4] == (
      "rl: steps 1-3, held-out evaluation every 2 steps; programs compile on first use"
  )
  best = smoke_run.summary()["best"]
  assert ours[-1].startswith("done: 3 RL steps (1-3) in ")
  assert (
      f"; best eval success {best['score']:.2f} at step {best['step']}; files in "
      f"{smoke_run.workdir} ("
  ) in ours[-1], ours[-1]
