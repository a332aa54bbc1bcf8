"""RLVR (RL with verifiable rewards): config, pre-flight checks and the pipeline."""
