"""Processes, pools and parallel layouts of one SPMD run.

``env`` reads the launcher's environment and starts torch.distributed; ``pools`` carves the world
into named rank ranges with their own process groups; ``dims`` holds the pure parallel layouts
(FSDP/HSDP, Ulysses, Megatron, rollout); ``plan`` holds ``plan()``, the one validation run before
any process group exists; ``world`` builds every pool's groups and meshes on every rank; ``comm``
moves data between ranks and pools; ``testing`` runs functions on N gloo CPU processes for tests.
``watchdog`` ends a run that stalls on a stopped or hung rank, naming it; ``process`` starts and
ends a trainer process under its launcher (dies with torchrun's agent, exits without aborting).
"""
