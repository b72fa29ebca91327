"""What the tests share and are not tests themselves: real processes (procs), scrape and
wait helpers (helpers), fakes (clock, fake_nvml), tiny torch datasets (torch_helpers, the
one module here that imports torch at its top), certificates (tls), rule files (rulefiles),
committed trainer snapshots (real_snapshots), and the scripts that subprocesses run
(ddp_job, tuner_job). Imported as `support.<module>`: the tests' directory is on sys.path
(pytest puts it there; the subprocesses get it through PYTHONPATH)."""
