def run(context):
    return {"agent": "three"}
