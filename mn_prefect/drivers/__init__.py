"""How a placed run is started on its node (docs/drivers.md): ``launchers`` holds the one driver table (host_local,
docker), ``container`` the pure mapping of a placement to container settings, ``docker`` the Docker I/O.
Nothing here is imported by the package itself: the CLI stays free of Prefect until a command needs it."""
