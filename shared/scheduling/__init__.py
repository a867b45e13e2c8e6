"""Scheduling without tensors: the measured cost model and the policies that use it."""
