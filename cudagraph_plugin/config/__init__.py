"""Configuration, pure Python: read the settings from any host config, check them against
every rule and the environment, advise, and plan and write the automatic fixes — a straight
path read (``settings``) -> check (``rules``, ``environment``) -> verdict (``check``).

No torch and no megatron-core import anywhere in this package: ``check_config`` gives a run's
verdict on a laptop.
"""
