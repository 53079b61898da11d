"""`vgpuctl serve`: the REST API over the Controller, its workers and the leader's loops."""
