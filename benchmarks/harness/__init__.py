"""The benchmarks' one harness: every study is a short declaration on it (see ``benchmarks/README.md``).

Its parts, one concept each:

* :mod:`~harness.load`: the load gate (the machine's 1-minute load before and after every timed phase; the
  runnable threads that are not the job's own, sampled from ``/proc`` during it; a phase above the limit is not
  published, the study waits and runs it again);
* :mod:`~harness.repeats`: interleaved repeats and the median with [min, max];
* :mod:`~harness.links`: the shaped links (a network namespace per rank, ``tbf`` on both ends of every pair);
* :mod:`~harness.jobs`: a job's ranks on that network, each writing its result to a file;
* :mod:`~harness.phases`: jobs whose ranks run phases (train, then time at each link) one at a time, gated;
* :mod:`~harness.matrix`: the fault matrices' frame (the cases run one at a time, gated, under one job secret;
  their table published);
* :mod:`~harness.results`: one result format (JSON and Markdown: the command, the date, the machine, the loads);
* :mod:`~harness.plots`: one plotting module;
* :mod:`~harness.machine`: the machine in words, the versions, the load average;
* :mod:`~harness.console`: what a study prints while it runs;
* :mod:`~harness.study`: a study's declaration (:class:`~harness.study.Study`) and the loop that runs it.

The studies run as ``python benchmarks/<study>.py``, so ``benchmarks/`` is on ``sys.path`` and they import this
package as ``harness``.
"""
