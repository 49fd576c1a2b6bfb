"""What the forkserver behind :func:`hpcrl.comm.spawn` imports once, so that local ranks start as forks
of a process that has torch loaded instead of importing it again each (about 1 s and 200 MB per rank).

Imported only in that server process, never in a rank or a user's process. It lives outside
``hpcrl.comm`` because importing that package imports torch, and two things must come first:

* one OpenMP thread: a forked child inherits no threads, so the server must not have started a
  thread pool that a child would believe it owns (each rank sets its own thread count);
* the stop signals blocked: a job-wide SIGTERM (a scheduler stopping every process of a job) must not
  end the server, whose ranks would die with it (their parent-death signal) before they checkpoint.
  A rank sets its own mask, the one its launcher had, once its handlers are in place.

A server forked from its launcher (:mod:`hpcrl.comm.prefork`) has torch loaded and no thread
already; there the mask is what this module still does.
"""

import os
import signal

os.environ["OMP_NUM_THREADS"] = "1"
signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT))

import torch  # noqa: E402,F401  the point of this module
import torch._dynamo  # noqa: E402,F401  every rank builds an optimizer, whose constructor imports it (~1 s)

import hpcrl.comm.spawn_child  # noqa: E402,F401  what every rank runs first
