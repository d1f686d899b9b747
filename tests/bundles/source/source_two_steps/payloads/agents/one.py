def run(context):
    return {"agent": "one"}
