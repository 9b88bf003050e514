"""The routing decision, pure: the cost model, policies, candidates and predicted entries."""
