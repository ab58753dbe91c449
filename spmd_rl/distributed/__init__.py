"""Processes, pools and parallel layouts of one SPMD run: the bottom layer of the package.

``env`` reads the launcher's environment and starts torch.distributed; ``pools`` carves the world
into named rank ranges with their own process groups; ``dims`` holds the pure parallel layouts
(FSDP/HSDP, Ulysses, Megatron, rollout); ``comm`` moves data between ranks and pools; ``bridge``
moves rows and weights between pools; ``service`` is the one protocol between the actor's pool and
a serving pool (commands, stop / abort, errors relayed to every client); ``testing`` runs functions on N gloo CPU
processes for tests. ``watchdog`` ends a run that stalls on a stopped or hung rank, naming it;
``process`` starts and ends a trainer process under its launcher (dies with torchrun's agent, exits
without aborting).

Nothing here imports the rest of ``spmd_rl`` (``tests/test_layers.py`` holds it): planning a run
(:mod:`spmd_rl.plan`), building its groups (:mod:`spmd_rl.world`) and the roles served on pools sit
above and use these pieces.
"""
