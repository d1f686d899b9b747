"""Register mn-prefect's block types with the Prefect server and save a store block (and a webhook block).

    python blocks/register.py [--name default] [--url URL]   (URL defaults to MN_STORE_URL or the SQLite file)
    python blocks/register.py --webhook-name ops --webhook-url https://ops.example.com/hooks/mn
        (the secret from MN_WEBHOOK_SECRET, never a flag: flags show in the process list)
Equivalent to `prefect block register -m mn_prefect.blocks` plus saving the blocks.
"""

import argparse
import os

from pydantic import ValidationError

from mn_prefect.blocks import MNClusterStore, MNNotificationWebhook

WEBHOOK_SECRET_VAR = "MN_WEBHOOK_SECRET"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="default")
    parser.add_argument("--url", default=None)
    parser.add_argument("--webhook-name", default=None, help="Also save an MNNotificationWebhook block by this name.")
    parser.add_argument("--webhook-url", default=None, help="Its http(s) address.")
    parser.add_argument("--webhook-events", default=None, help="Comma-separated: ONLINE,OFFLINE,DEALLOCATION (all).")
    args = parser.parse_args()
    if bool(args.webhook_name) != bool(args.webhook_url):
        parser.error("--webhook-name and --webhook-url go together")
    webhook = None
    if args.webhook_name:
        secret = os.environ.get(WEBHOOK_SECRET_VAR)
        if not secret:
            parser.error(f"a webhook needs its signing secret in {WEBHOOK_SECRET_VAR}")
        events = {"events": args.webhook_events} if args.webhook_events else {}
        try:
            webhook = MNNotificationWebhook(url=args.webhook_url, secret=secret, **events)
        except ValidationError as error:  # names the field: url, events
            parser.error("; ".join(f"webhook {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()))
    MNClusterStore.register_type_and_schema()
    MNNotificationWebhook.register_type_and_schema()
    block = MNClusterStore(url=args.url) if args.url else MNClusterStore()
    password = os.environ.get("MN_STORE_PASSWORD")
    if password:
        block.password = password
    block.save(args.name, overwrite=True)
    print(f"saved block mn-cluster-store/{args.name}")
    if webhook is not None:
        webhook.save(args.webhook_name, overwrite=True)
        print(f"saved block mn-notification-webhook/{args.webhook_name} (set MN_NOTIFY_BLOCKS={args.webhook_name})")


if __name__ == "__main__":
    main()
