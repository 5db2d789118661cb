"""Mixture-of-experts routers: the auxiliary load-balancing loss and auxiliary-loss-free bias balancing."""
