"""Placement on top of the store: what decides where runs go and says so.

* ``placing``: the Placer, plan against the store's view and commit, re-planning on conflict (every booking:
  worker, blueprint coordinator, bundle runner, reservations);
* ``reservations``: capacity booked now, for a while; runs placed inside one;
* ``ending``: a reservation's end announced (the store ends it, ``store.expiry``, and publishes nothing);
* ``job_state``: a blueprint job's record read and released.

Imports the store, scheduler and model layers, and ``events`` / ``notify`` to announce what it decided; the
store imports none of it.
"""
