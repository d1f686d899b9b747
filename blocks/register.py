"""Register mn-prefect's block types with the Prefect server and save a store block.

    python blocks/register.py [--name default] [--url URL]   (URL defaults to MN_STORE_URL or the SQLite file)
Equivalent to `prefect block register -m mn_prefect.blocks` plus saving one block.
"""

import argparse
import os

from mn_prefect.blocks import MNClusterStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="default")
    parser.add_argument("--url", default=None)
    args = parser.parse_args()
    MNClusterStore.register_type_and_schema()
    block = MNClusterStore(url=args.url) if args.url else MNClusterStore()
    password = os.environ.get("MN_STORE_PASSWORD")
    if password:
        block.password = password
    block.save(args.name, overwrite=True)
    print(f"saved block mn-cluster-store/{args.name}")


if __name__ == "__main__":
    main()
