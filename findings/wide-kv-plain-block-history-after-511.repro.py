#!/usr/bin/env python3
r"""Reproducer of the failing hybrid prefix-cache case wide-kv-plain-block-history-after-511.

Written by the suite from the case's record (wide-kv-plain-block-history-after-511.json). The case
had hit unit 128 and block 128, and failed with:

    sampled logprobs differ from the recompute

MODEL
The CPU tier's tiny Qwen3-Next model (the suite served /tmp/tiny-find-wide).
Write it into MODEL_DIR from a vLLM checkout with this suite's
tests/ laid over it:

    cd /work/main/.vllm-checkout/vllm-0.32.0
    /work/main/.venv/bin/python -m tests.models.hybrid_prefix_cache.tiny_hybrid MODEL_DIR --variant wide-kv

SERVER
The suite ran vLLM 0.32.0 from
/work/main/.venv/lib/python3.11/site-packages/vllm/__init__.py. Start the
server(s) as it did:

    # serve
    HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 vllm serve MODEL_DIR \
        --enable-prompt-tokens-details --max-model-len 4096 \
        --kv-cache-memory-bytes 1G --max-num-seqs 8 -O0 --enable-prefix-caching \
        --distributed-executor-backend uni --port 8000

RUN
    python wide-kv-plain-block-history-after-511.repro.py --url http://localhost:8000

It replays conversation history-after-511 (history-after-511 turn 0,
history-after-511 turn 1, history-after-511 turn 2 (checked)), one request
at a time, each conversation under a fresh salt made from the recorded one
(--exact-salts: the recorded one), then sends every checked turn again under
another fresh salt and prints the suite's verdict. Exit status 1: the
failure reproduced; 0: it did not. A case that played its conversations at
once may need that load to fail; the servers' counters are not checked here.
"""

import argparse
import sys
import time
import uuid

import requests

CASE = {'case_id': 'wide-kv-plain-block-history-after-511',
 'hit_unit': 128,
 'logprob_atol': 0.0,
 'compares_logprobs': True,
 'pd': False,
 'offload': False,
 'max_tokens': 8,
 'logprobs': 5,
 'prefill_kv_transfer_params': None,
 'conversations': [{'label': 'history-after-511',
                    'salt': 'conversation-18edcbb7da3842539b21f12fdbb0269f',
                    'turns': [{'name': 'history-after-511 turn 0',
                               'prompt_len': 511,
                               'expected': 0,
                               'bound': 0,
                               'check': False,
                               'recompute': False,
                               'recorded_cached': None,
                               'recorded_problems': [],
                               'prompt': [515, 828, 1788, 1647, 1614, 1787, 819, 1862,
                                          1387, 1932, 1090, 1593, 609, 1445, 449, 835,
                                          221, 79, 1695, 521, 1546, 1208, 379, 396,
                                          1378, 1037, 1090, 372, 1816, 1052, 316, 1836,
                                          1008, 806, 1817, 1757, 139, 610, 1965, 1090,
                                          441, 450, 1910, 386, 508, 1363, 719, 1913,
                                          1955, 697, 1955, 155, 117, 1991, 1197, 1174,
                                          867, 398, 1650, 612, 747, 1148, 941, 1891,
                                          1234, 80, 771, 1102, 1139, 80, 780, 1343, 80,
                                          972, 1626, 1219, 144, 1937, 1686, 526, 284,
                                          897, 174, 1400, 856, 188, 61, 141, 944, 1027,
                                          968, 688, 1156, 1092, 1169, 863, 1462, 441,
                                          789, 1117, 782, 496, 657, 1196, 1905, 1263,
                                          1147, 96, 1801, 1628, 411, 165, 1592, 1991,
                                          899, 1907, 1418, 2045, 160, 440, 894, 449,
                                          2026, 1842, 1034, 454, 1540, 1599, 734, 1706,
                                          1140, 700, 1633, 1483, 651, 1226, 802, 1268,
                                          1414, 1822, 644, 631, 250, 562, 183, 91, 895,
                                          182, 9, 730, 1197, 100, 765, 1869, 150, 1140,
                                          193, 209, 726, 1681, 1403, 1584, 1200, 1396,
                                          561, 128, 1437, 1626, 53, 311, 885, 244, 1992,
                                          239, 1390, 1426, 76, 1085, 864, 912, 967, 716,
                                          861, 1720, 1994, 599, 2005, 35, 1748, 232,
                                          758, 87, 1247, 901, 1201, 1490, 1826, 1227,
                                          509, 1418, 1270, 1749, 1121, 807, 314, 615,
                                          704, 964, 660, 977, 84, 867, 21, 133, 558,
                                          683, 244, 90, 734, 1352, 1959, 1242, 1188,
                                          392, 1165, 2046, 1364, 1438, 31, 1207, 785,
                                          1107, 286, 1908, 1782, 1927, 918, 739, 177,
                                          528, 660, 90, 1481, 2013, 108, 764, 939, 1344,
                                          668, 285, 1967, 458, 1827, 324, 155, 1387,
                                          1495, 1888, 855, 691, 924, 887, 1362, 755,
                                          472, 1373, 170, 1535, 686, 1974, 1774, 1487,
                                          1534, 155, 1399, 299, 481, 162, 1741, 836,
                                          496, 1836, 1043, 1718, 1306, 277, 1425, 287,
                                          1052, 752, 1065, 613, 1220, 1354, 885, 488,
                                          1847, 1220, 128, 1476, 1197, 1773, 400, 1020,
                                          436, 1386, 1447, 1035, 605, 856, 704, 32, 80,
                                          1957, 1627, 942, 654, 506, 2038, 1733, 1920,
                                          1715, 613, 808, 431, 942, 1197, 1467, 684,
                                          1605, 1917, 1370, 1319, 2029, 1565, 1671,
                                          1069, 813, 482, 1210, 1914, 1341, 716, 305,
                                          666, 842, 176, 1036, 1010, 284, 1101, 1380,
                                          2036, 384, 676, 1959, 169, 1902, 242, 240,
                                          2029, 59, 1259, 1477, 1902, 1411, 599, 443,
                                          1444, 303, 573, 415, 1523, 1086, 1570, 2030,
                                          1109, 1992, 1706, 1797, 463, 989, 1264, 1993,
                                          1562, 455, 1461, 732, 229, 1427, 509, 34,
                                          1021, 334, 947, 98, 1032, 136, 1538, 496,
                                          2021, 1545, 1787, 1784, 1298, 1563, 497, 643,
                                          1978, 2010, 1508, 1051, 96, 851, 777, 334,
                                          765, 1307, 107, 1727, 1390, 61, 2005, 320,
                                          581, 645, 901, 215, 1723, 503, 1840, 1337,
                                          713, 1981, 1062, 747, 1479, 490, 924, 1322,
                                          279, 190, 373, 247, 68, 1498, 1245, 1943, 83,
                                          79, 1630, 258, 1055, 476, 2045, 1396, 1239,
                                          379, 725, 1549, 1480, 920, 1187, 1770, 1705,
                                          1387, 446, 1293, 795, 633, 1290, 4, 46, 808,
                                          901, 1343, 2002, 319, 501, 260, 1095, 455,
                                          879, 1830, 230, 574, 392, 726, 1364, 78, 1031,
                                          631, 1753, 1904, 1248, 1922, 135, 557, 1161,
                                          1421, 1357, 396, 190, 1686, 1269, 1857, 1945,
                                          65, 1902, 402, 1367]},
                              {'name': 'history-after-511 turn 1',
                               'prompt_len': 513,
                               'expected': 384,
                               'bound': 384,
                               'check': False,
                               'recompute': False,
                               'recorded_cached': None,
                               'recorded_problems': [],
                               'prompt': [515, 828, 1788, 1647, 1614, 1787, 819, 1862,
                                          1387, 1932, 1090, 1593, 609, 1445, 449, 835,
                                          221, 79, 1695, 521, 1546, 1208, 379, 396,
                                          1378, 1037, 1090, 372, 1816, 1052, 316, 1836,
                                          1008, 806, 1817, 1757, 139, 610, 1965, 1090,
                                          441, 450, 1910, 386, 508, 1363, 719, 1913,
                                          1955, 697, 1955, 155, 117, 1991, 1197, 1174,
                                          867, 398, 1650, 612, 747, 1148, 941, 1891,
                                          1234, 80, 771, 1102, 1139, 80, 780, 1343, 80,
                                          972, 1626, 1219, 144, 1937, 1686, 526, 284,
                                          897, 174, 1400, 856, 188, 61, 141, 944, 1027,
                                          968, 688, 1156, 1092, 1169, 863, 1462, 441,
                                          789, 1117, 782, 496, 657, 1196, 1905, 1263,
                                          1147, 96, 1801, 1628, 411, 165, 1592, 1991,
                                          899, 1907, 1418, 2045, 160, 440, 894, 449,
                                          2026, 1842, 1034, 454, 1540, 1599, 734, 1706,
                                          1140, 700, 1633, 1483, 651, 1226, 802, 1268,
                                          1414, 1822, 644, 631, 250, 562, 183, 91, 895,
                                          182, 9, 730, 1197, 100, 765, 1869, 150, 1140,
                                          193, 209, 726, 1681, 1403, 1584, 1200, 1396,
                                          561, 128, 1437, 1626, 53, 311, 885, 244, 1992,
                                          239, 1390, 1426, 76, 1085, 864, 912, 967, 716,
                                          861, 1720, 1994, 599, 2005, 35, 1748, 232,
                                          758, 87, 1247, 901, 1201, 1490, 1826, 1227,
                                          509, 1418, 1270, 1749, 1121, 807, 314, 615,
                                          704, 964, 660, 977, 84, 867, 21, 133, 558,
                                          683, 244, 90, 734, 1352, 1959, 1242, 1188,
                                          392, 1165, 2046, 1364, 1438, 31, 1207, 785,
                                          1107, 286, 1908, 1782, 1927, 918, 739, 177,
                                          528, 660, 90, 1481, 2013, 108, 764, 939, 1344,
                                          668, 285, 1967, 458, 1827, 324, 155, 1387,
                                          1495, 1888, 855, 691, 924, 887, 1362, 755,
                                          472, 1373, 170, 1535, 686, 1974, 1774, 1487,
                                          1534, 155, 1399, 299, 481, 162, 1741, 836,
                                          496, 1836, 1043, 1718, 1306, 277, 1425, 287,
                                          1052, 752, 1065, 613, 1220, 1354, 885, 488,
                                          1847, 1220, 128, 1476, 1197, 1773, 400, 1020,
                                          436, 1386, 1447, 1035, 605, 856, 704, 32, 80,
                                          1957, 1627, 942, 654, 506, 2038, 1733, 1920,
                                          1715, 613, 808, 431, 942, 1197, 1467, 684,
                                          1605, 1917, 1370, 1319, 2029, 1565, 1671,
                                          1069, 813, 482, 1210, 1914, 1341, 716, 305,
                                          666, 842, 176, 1036, 1010, 284, 1101, 1380,
                                          2036, 384, 676, 1959, 169, 1902, 242, 240,
                                          2029, 59, 1259, 1477, 1902, 1411, 599, 443,
                                          1444, 303, 573, 415, 1523, 1086, 1570, 2030,
                                          1109, 1992, 1706, 1797, 463, 989, 1264, 1993,
                                          1562, 455, 1461, 732, 229, 1427, 509, 34,
                                          1021, 334, 947, 98, 1032, 136, 1538, 496,
                                          2021, 1545, 1787, 1784, 1298, 1563, 497, 643,
                                          1978, 2010, 1508, 1051, 96, 851, 777, 334,
                                          765, 1307, 107, 1727, 1390, 61, 2005, 320,
                                          581, 645, 901, 215, 1723, 503, 1840, 1337,
                                          713, 1981, 1062, 747, 1479, 490, 924, 1322,
                                          279, 190, 373, 247, 68, 1498, 1245, 1943, 83,
                                          79, 1630, 258, 1055, 476, 2045, 1396, 1239,
                                          379, 725, 1549, 1480, 920, 1187, 1770, 1705,
                                          1387, 446, 1293, 795, 633, 1290, 4, 46, 808,
                                          901, 1343, 2002, 319, 501, 260, 1095, 455,
                                          879, 1830, 230, 574, 392, 726, 1364, 78, 1031,
                                          631, 1753, 1904, 1248, 1922, 135, 557, 1161,
                                          1421, 1357, 396, 190, 1686, 1269, 1857, 1945,
                                          65, 1902, 402, 1367, 1964, 443]},
                              {'name': 'history-after-511 turn 2',
                               'prompt_len': 514,
                               'expected': 512,
                               'bound': 512,
                               'check': True,
                               'recompute': True,
                               'recorded_cached': None,
                               'recorded_problems': ['sampled logprobs differ from the '
                                                     'recompute'],
                               'prompt': [515, 828, 1788, 1647, 1614, 1787, 819, 1862,
                                          1387, 1932, 1090, 1593, 609, 1445, 449, 835,
                                          221, 79, 1695, 521, 1546, 1208, 379, 396,
                                          1378, 1037, 1090, 372, 1816, 1052, 316, 1836,
                                          1008, 806, 1817, 1757, 139, 610, 1965, 1090,
                                          441, 450, 1910, 386, 508, 1363, 719, 1913,
                                          1955, 697, 1955, 155, 117, 1991, 1197, 1174,
                                          867, 398, 1650, 612, 747, 1148, 941, 1891,
                                          1234, 80, 771, 1102, 1139, 80, 780, 1343, 80,
                                          972, 1626, 1219, 144, 1937, 1686, 526, 284,
                                          897, 174, 1400, 856, 188, 61, 141, 944, 1027,
                                          968, 688, 1156, 1092, 1169, 863, 1462, 441,
                                          789, 1117, 782, 496, 657, 1196, 1905, 1263,
                                          1147, 96, 1801, 1628, 411, 165, 1592, 1991,
                                          899, 1907, 1418, 2045, 160, 440, 894, 449,
                                          2026, 1842, 1034, 454, 1540, 1599, 734, 1706,
                                          1140, 700, 1633, 1483, 651, 1226, 802, 1268,
                                          1414, 1822, 644, 631, 250, 562, 183, 91, 895,
                                          182, 9, 730, 1197, 100, 765, 1869, 150, 1140,
                                          193, 209, 726, 1681, 1403, 1584, 1200, 1396,
                                          561, 128, 1437, 1626, 53, 311, 885, 244, 1992,
                                          239, 1390, 1426, 76, 1085, 864, 912, 967, 716,
                                          861, 1720, 1994, 599, 2005, 35, 1748, 232,
                                          758, 87, 1247, 901, 1201, 1490, 1826, 1227,
                                          509, 1418, 1270, 1749, 1121, 807, 314, 615,
                                          704, 964, 660, 977, 84, 867, 21, 133, 558,
                                          683, 244, 90, 734, 1352, 1959, 1242, 1188,
                                          392, 1165, 2046, 1364, 1438, 31, 1207, 785,
                                          1107, 286, 1908, 1782, 1927, 918, 739, 177,
                                          528, 660, 90, 1481, 2013, 108, 764, 939, 1344,
                                          668, 285, 1967, 458, 1827, 324, 155, 1387,
                                          1495, 1888, 855, 691, 924, 887, 1362, 755,
                                          472, 1373, 170, 1535, 686, 1974, 1774, 1487,
                                          1534, 155, 1399, 299, 481, 162, 1741, 836,
                                          496, 1836, 1043, 1718, 1306, 277, 1425, 287,
                                          1052, 752, 1065, 613, 1220, 1354, 885, 488,
                                          1847, 1220, 128, 1476, 1197, 1773, 400, 1020,
                                          436, 1386, 1447, 1035, 605, 856, 704, 32, 80,
                                          1957, 1627, 942, 654, 506, 2038, 1733, 1920,
                                          1715, 613, 808, 431, 942, 1197, 1467, 684,
                                          1605, 1917, 1370, 1319, 2029, 1565, 1671,
                                          1069, 813, 482, 1210, 1914, 1341, 716, 305,
                                          666, 842, 176, 1036, 1010, 284, 1101, 1380,
                                          2036, 384, 676, 1959, 169, 1902, 242, 240,
                                          2029, 59, 1259, 1477, 1902, 1411, 599, 443,
                                          1444, 303, 573, 415, 1523, 1086, 1570, 2030,
                                          1109, 1992, 1706, 1797, 463, 989, 1264, 1993,
                                          1562, 455, 1461, 732, 229, 1427, 509, 34,
                                          1021, 334, 947, 98, 1032, 136, 1538, 496,
                                          2021, 1545, 1787, 1784, 1298, 1563, 497, 643,
                                          1978, 2010, 1508, 1051, 96, 851, 777, 334,
                                          765, 1307, 107, 1727, 1390, 61, 2005, 320,
                                          581, 645, 901, 215, 1723, 503, 1840, 1337,
                                          713, 1981, 1062, 747, 1479, 490, 924, 1322,
                                          279, 190, 373, 247, 68, 1498, 1245, 1943, 83,
                                          79, 1630, 258, 1055, 476, 2045, 1396, 1239,
                                          379, 725, 1549, 1480, 920, 1187, 1770, 1705,
                                          1387, 446, 1293, 795, 633, 1290, 4, 46, 808,
                                          901, 1343, 2002, 319, 501, 260, 1095, 455,
                                          879, 1830, 230, 574, 392, 726, 1364, 78, 1031,
                                          631, 1753, 1904, 1248, 1922, 135, 557, 1161,
                                          1421, 1357, 396, 190, 1686, 1269, 1857, 1945,
                                          65, 1902, 402, 1367, 1964, 443, 554]}]}]}

TIMEOUT = 600
TOKEN_ID_PREFIX = "token_id:"


def post(url, path, body=None, params=None):
    try:
        response = requests.post(
            f"{url}/{path}", json=body, params=params, timeout=TIMEOUT
        )
    except requests.RequestException as e:
        sys.exit(f"{url} did not answer {path}: {type(e).__name__}: {e}")
    if response.status_code != 200:
        text = response.text[:2000]
        sys.exit(f"{url}/{path} answered {response.status_code}: {text}")
    return response.json()


def served_model(url):
    try:
        response = requests.get(f"{url}/v1/models", timeout=60)
        response.raise_for_status()
    except requests.RequestException as e:
        sys.exit(f"no server at {url}: {type(e).__name__}: {e}")
    return response.json()["data"][0]["id"]


def complete(url, model, prompt, salt, max_tokens, kv_transfer_params=None):
    """A greedy completion of the token-id prompt under the salt."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": CASE["logprobs"],
        "cache_salt": salt,
        "return_tokens_as_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    data = post(url, "v1/completions", body)
    choice, usage = data["choices"][0], data["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        sys.exit(
            f"{url} reports no usage.prompt_tokens_details.cached_tokens: "
            "serve with --enable-prompt-tokens-details"
        )
    logprobs = choice["logprobs"]
    return {
        "tokens": [int(t.removeprefix(TOKEN_ID_PREFIX)) for t in logprobs["tokens"]],
        "logprobs": list(logprobs["token_logprobs"]),
        "prompt_tokens": usage["prompt_tokens"],
        "cached": cached,
        "kv_transfer_params": data.get("kv_transfer_params"),
    }


def send(urls, model, prompt, salt):
    """A turn: to the server, or under P/D to the prefiller (whose prefix
    cache is consulted: its hit is the turn's) and then to the decoder,
    which pulls the prefiller's KV."""
    if len(urls) == 1:
        return complete(urls[0], model, prompt, salt, CASE["max_tokens"])
    params = CASE["prefill_kv_transfer_params"]
    prefill = complete(urls[0], model, prompt, salt, 1, params)
    if not prefill["kv_transfer_params"]:
        sys.exit(f"the prefiller {urls[0]} returned no kv_transfer_params")
    decode = complete(
        urls[1], model, prompt, salt, CASE["max_tokens"], prefill["kv_transfer_params"]
    )
    return {**decode, "cached": prefill["cached"]}


def reset_prefix_caches(urls):
    """Drop the device prefix caches, keeping the offloaded one, so that a
    hit must come from the offload tier (serve with VLLM_SERVER_DEV_MODE=1)."""
    for url in urls:
        for _ in range(120):
            if post(url, "reset_prefix_cache", params={"reset_external": "false"}).get(
                "success"
            ):
                break
            time.sleep(0.5)
        else:
            sys.exit(f"{url}/reset_prefix_cache kept answering success=false")


def check(turn, hit, recompute):
    """The suite's verdict on one turn: its problems and its notices."""
    problems, notices = [], []
    unit, cached = CASE["hit_unit"], hit["cached"]
    for sample, what in ((hit, "hit"), (recompute, "recompute")):
        if sample is not None and sample["prompt_tokens"] != turn["prompt_len"]:
            problems.append(
                f"the {what} reports {sample['prompt_tokens']} prompt tokens, "
                f"sent {turn['prompt_len']}"
            )
    if cached < turn["expected"]:
        problems.append(
            f"cached {cached} < expected checkpoint {turn['expected']} (hit unit "
            f"{unit}): a checkpoint was lost"
            + (" (no hit at all)" if not cached else "")
        )
    if cached > turn["bound"] or (unit and cached % unit):
        problems.append(
            f"impossible hit, over-reported: cached {cached} (bound {turn['bound']}, "
            f"hit unit {unit})"
        )
    elif cached > turn["expected"]:
        notices.append(f"cached {cached} is above the expected {turn['expected']}")
    if recompute is None:
        return problems, notices
    if recompute["cached"] != 0:
        problems.append(
            f"the recompute under a fresh cache_salt reported {recompute['cached']} "
            f"cached tokens, expected 0"
        )
    if not CASE["compares_logprobs"]:
        return problems, notices
    atol = CASE["logprob_atol"]
    pairs = list(zip(hit["tokens"], recompute["tokens"]))
    diverged = [i for i, (a, b) in enumerate(pairs) if a != b]
    if diverged or len(hit["tokens"]) != len(recompute["tokens"]):
        i = diverged[0] if diverged else len(pairs)
        where = f"first diverging token at index {i}: hit {hit['tokens'][i:i + 1]}, "
        where += f"recompute {recompute['tokens'][i:i + 1]}"
        if atol is not None:
            problems.append(f"output differs from the recompute: {where}")
        else:
            notices.append(f"{where} (the suite lets check_logprobs_close decide)")
        return problems, notices
    pairs = zip(hit["logprobs"], recompute["logprobs"])
    diff = max((abs(a - b) for a, b in pairs), default=0.0)
    if atol is not None and diff > atol:
        problems.append(
            f"sampled logprobs differ from the recompute by {diff:.3g} > {atol:g}, "
            f"with the same tokens: the restored state is wrong"
        )
    return problems, notices


def main():
    parser = argparse.ArgumentParser(
        description=f"Replay the failing turns of {CASE['case_id']}."
    )
    parser.add_argument("--url", default="http://localhost:8000", help="the server")
    parser.add_argument("--prefill-url", help="P/D: the prefiller")
    parser.add_argument("--decode-url", help="P/D: the decoder")
    parser.add_argument(
        "--exact-salts",
        action="store_true",
        help="use the recorded salts (on a server that never saw them)",
    )
    args = parser.parse_args()
    if CASE["pd"]:
        if not (args.prefill_url and args.decode_url):
            parser.error("this case ran under P/D: give --prefill-url and --decode-url")
        urls = [args.prefill_url, args.decode_url]
    else:
        urls = [args.url]
    urls = [url.rstrip("/") for url in urls]
    model = served_model(urls[-1])
    checked = failed = 0
    for conversation in CASE["conversations"]:
        salt = conversation["salt"]
        if not args.exact_salts:
            salt = f"{salt}-replay-{uuid.uuid4().hex[:8]}"
        for turn in conversation["turns"]:
            if CASE["offload"]:
                reset_prefix_caches(urls)
            hit = send(urls, model, turn["prompt"], salt)
            if not turn["check"]:
                print(
                    f"{turn['name']}: replayed ({turn['prompt_len']} tokens), cached "
                    f"{hit['cached']} (the suite saw {turn['recorded_cached']})"
                )
                continue
            recompute = None
            if turn["recompute"]:
                fresh = f"recompute-{uuid.uuid4().hex}"
                recompute = complete(
                    urls[-1], model, turn["prompt"], fresh, CASE["max_tokens"]
                )
            problems, notices = check(turn, hit, recompute)
            checked += 1
            failed += bool(problems)
            print(
                f"{turn['name']}: {'FAIL' if problems else 'ok'}: {turn['prompt_len']} "
                f"tokens, cached {hit['cached']} (expected {turn['expected']}, bound "
                f"{turn['bound']})"
            )
            for problem in problems:
                print(f"  problem: {problem}")
            for notice in notices:
                print(f"  notice: {notice}")
            for problem in turn["recorded_problems"]:
                print(f"  the suite saw: {problem}")
    if failed:
        print(f"reproduced: {failed} of {checked} checked turns FAIL, as in the suite")
        return 1
    print(f"not reproduced: all {checked} checked turns pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
