"""Capacity planning on a copy of a fleet: what-if replays of a demand, stranded capacity, the carving advisor.

Pure: it reads only the files it is given (a demand, an inventory, a trace) and never a store; the service layer
hands it a snapshot of the store as plain objects (`vgpu_ctl.service.fleet_snapshot`).
"""
