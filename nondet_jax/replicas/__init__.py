"""The execution strategies that run the single-replica training functions for R replicas."""
