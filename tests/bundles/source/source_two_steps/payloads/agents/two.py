def run(context):
    return {"agent": "two"}
