"""The composition root: the experiment config tree, the flavor registry, the Lightning harness, the CLI,
pipeline and report orchestration, and packaging. The only package that knows every other one."""
