"""Engines: the one protocol the command line and the server drive (``protocol``), the requests'
host state (``host``: per DP group request tables, ``requests``, and routing), the scheduler that
drives it (``scheduler``), the capacity contract (``capacity``) and the reference engine
(``reference``); ``GraphEngine`` lives with the cluster it schedules on (``dsv41.cluster.engine``)."""
