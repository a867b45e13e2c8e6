"""The scheduler service: the request pool and the iteration loop of DESIGN §2."""
