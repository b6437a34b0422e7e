"""The command line, all of it: ``run`` (``python -m dsv41.run``: parser, entry point, the steps),
``modes`` and ``args`` (which flag goes with which mode, every value checked before any work),
``budget`` (refuse what cannot fit in memory), ``plan`` and ``trace`` (``--plan``, ``--trace``,
``--report`` and their kin), ``prompts``, ``progress``, and the two other commands, ``replay`` and
``write_checkpoint``. The old module paths (``dsv41.run``, ``dsv41.replay``,
``dsv41.checkpoint.write``) only call these mains."""
