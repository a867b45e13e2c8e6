"""The scheduler service: the request pool and its lanes, an executor of the scheduler core."""
