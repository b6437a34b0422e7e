"""Engines: the one protocol the command line and the server drive (``protocol``), the host's
request table (``requests``) and the reference engine (``reference``); ``GraphEngine`` lives with
the cluster it schedules on (``dsv41.cluster.engine``)."""
