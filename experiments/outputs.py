"""Output files an entry point writes after its work: checked before the work starts.

`eval.py --json=PATH` and `ablate.py --out=PATH` write their files once the
evaluation or the tables are done; a path that cannot be written would end
in a traceback after that work. `check_output_file` refuses it at start, in
one line naming the flag: a missing folder is refused, not created (a
mistyped folder would otherwise collect the results silently).
"""

from __future__ import annotations

import os

from absl import app


def check_output_file(flag: str, path: str) -> None:
  """Refuses an output file `path` of flag `flag` that could not be written.

  Args:
    flag: the flag's name as typed, e.g. '--json'.
    path: the file the entry point will write (created or replaced).
  Raises:
    app.UsageError: one line naming the flag, the path and what is allowed.
  """
  target = os.path.abspath(path)
  folder = os.path.dirname(target)
  if os.path.isdir(target):
    raise app.UsageError(f"{flag}={path!r} is a directory; allowed: a file path")
  if not os.path.isdir(folder):
    what = "is a file" if os.path.exists(folder) else "does not exist"
    raise app.UsageError(
        f"{flag}={path!r}: its folder {folder} {what}; allowed: a file in an "
        "existing folder (create it first)"
    )
  if not os.access(folder, os.W_OK | os.X_OK) or (
      os.path.exists(target) and not os.access(target, os.W_OK)
  ):
    raise app.UsageError(f"{flag}={path!r} is not writable; allowed: a writable file path")
