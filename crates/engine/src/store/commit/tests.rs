//! The commit, against the real Redis (REDIS_URL, else the local one), under keys of their own.
use super::*;
use crate::store::testing::*;
use std::collections::HashMap;

#[tokio::test]
async fn a_commit_marks_published_claims_and_releases_failed_ones_of_its_own_only() {
    let mut s = store("claims").await;
    let mut con = s.redis();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let mine = format!("{id}/1");
    let key = |n: &str| format!("test:claims:{id}:{n}");
    for (k, v) in [
        ("ok", mine.as_str()),
        ("bad", mine.as_str()),
        ("theirs", "x"),
    ] {
        redis::cmd("SET")
            .arg(key(k))
            .arg(v)
            .arg("EX")
            .arg(60)
            .query_async::<()>(&mut con)
            .await
            .unwrap();
    }
    let end = |n: &str, published| ClaimEnd {
        key: key(n),
        value: mine.clone(),
        published,
    };
    s.commit(
        &[],
        &[],
        &[end("ok", true), end("bad", false), end("theirs", false)],
        &Counts::default(),
    )
    .await
    .unwrap();
    let reader = con.clone();
    let get = |k: String| {
        let mut con = reader.clone();
        async move {
            let v: Option<String> = redis::cmd("GET")
                .arg(k)
                .query_async(&mut con)
                .await
                .unwrap();
            v
        }
    };
    assert_eq!(get(key("ok")).await, Some(confirmed_claim(&mine)));
    let ttl: i64 = redis::cmd("TTL")
        .arg(key("ok"))
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(ttl > 0, "the claim keeps its expiry: {ttl}");
    assert_eq!(get(key("bad")).await, None);
    assert_eq!(get(key("theirs")).await, Some("x".into()));
    let _: () = redis::cmd("DEL")
        .arg(key("ok"))
        .arg(key("theirs"))
        .query_async(&mut con)
        .await
        .unwrap();
    cleanup(&mut s, &[]).await;
}

#[tokio::test]
async fn counts_add_up_over_commits_and_a_key_marked_before_is_counted_again() {
    let mut s = store("counts").await;
    let d = |replayed, failed| Counts {
        replayed,
        failed,
        ..Default::default()
    };
    let marks = |k: &str| {
        vec![
            (format!("fp-{k}"), "replayed".to_string()),
            (crate::store::key_field(k), "replayed".to_string()),
        ]
    };
    let first = s.commit(&[row("a")], &marks("k1"), &[], &d(3, 0)).await;
    assert_eq!(first.expect("first"), (1, 0));
    // k1 was marked by the first commit; k2 comes twice in this one: both count again.
    let mut second = marks("k1");
    second.extend(marks("k2"));
    second.extend(marks("k2"));
    let (len, again) = s
        .commit(&[row("b"), row("c")], &second, &[], &d(4, 1))
        .await
        .expect("second");
    assert_eq!((len, again), (3, 2));
    let state: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(&s.keys().state)
        .query_async(&mut s.con)
        .await
        .expect("state");
    assert_eq!(state.get("c:replayed").map(String::as_str), Some("7"));
    assert_eq!(state.get("c:failed").map(String::as_str), Some("1"));
    let settled: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(&s.keys().settled)
        .query_async(&mut s.con)
        .await
        .expect("settled");
    for f in ["fp-k1", "key:k1", "fp-k2", "key:k2"] {
        assert_eq!(settled.get(f).map(String::as_str), Some("replayed"), "{f}");
    }
    cleanup(&mut s, &[]).await;
}

#[tokio::test]
async fn a_commit_larger_than_one_chunk_writes_every_row_mark_and_claim_end() {
    // Past the script's chunks of 1,000 arguments: every settled mark, `key:` mark and claim
    // end is applied once, and the first `key:` mark of a key is the one kept.
    let mut s = store("chunks").await;
    let mut con = s.redis();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let mine = format!("{id}/1");
    let n = 1_500;
    let claim = |i: usize| format!("test:chunks:{id}:{i}");
    let mut p = redis::pipe();
    for i in 0..n {
        p.cmd("SET")
            .arg(claim(i))
            .arg(&mine)
            .arg("EX")
            .arg(60)
            .ignore();
    }
    p.query_async::<()>(&mut con).await.unwrap();
    let rows: Vec<AuditRow> = (0..n).map(|i| row(&format!("m{i}"))).collect();
    let mut marks: Vec<(String, String)> = (0..n)
        .map(|i| (format!("fp-{i}"), "replayed".to_string()))
        .collect();
    marks.extend((0..n).map(|i| (crate::store::key_field(&format!("k{i}")), format!("m{i}"))));
    // k0 comes again at the end: counted, and its first mark kept.
    marks.push((crate::store::key_field("k0"), "late".into()));
    let ends: Vec<ClaimEnd> = (0..n)
        .map(|i| ClaimEnd {
            key: claim(i),
            value: mine.clone(),
            published: i % 2 == 0,
        })
        .collect();
    let delta = Counts {
        replayed: n as u64,
        ..Default::default()
    };
    let (len, again) = s.commit(&rows, &marks, &ends, &delta).await.unwrap();
    assert_eq!((len, again), (n as u64, 1));
    let settled: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(&s.keys().settled)
        .query_async(&mut s.con)
        .await
        .unwrap();
    assert_eq!(settled.len(), 2 * n);
    assert_eq!(settled.get("key:k0").map(String::as_str), Some("m0"));
    assert_eq!(
        settled.get(&format!("key:k{}", n - 1)).map(String::as_str),
        Some(&*format!("m{}", n - 1))
    );
    assert_eq!(
        settled.get(&format!("fp-{}", n - 1)).map(String::as_str),
        Some("replayed")
    );
    let keys: Vec<String> = (0..n).map(claim).collect();
    let values: Vec<Option<String>> = redis::cmd("MGET")
        .arg(&keys)
        .query_async(&mut con)
        .await
        .unwrap();
    for (i, v) in values.iter().enumerate() {
        let want = (i % 2 == 0).then(|| confirmed_claim(&mine));
        assert_eq!(v, &want, "claim {i}");
    }
    let mut p = redis::pipe();
    for k in &keys {
        p.cmd("DEL").arg(k).ignore();
    }
    p.query_async::<()>(&mut con).await.unwrap();
    cleanup(&mut s, &[]).await;
}

#[tokio::test]
async fn a_commit_loads_its_script_again_when_redis_lost_it() {
    let mut s = store("noscript").await;
    // What a restarted Redis (or SCRIPT FLUSH) leaves: no script cached. Other tests
    // running meanwhile reload theirs the same way.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut s.con)
        .await
        .expect("flush");
    let (len, _) = s
        .commit(&[row("a")], &[], &[], &Counts::default())
        .await
        .expect("commit after a flush");
    assert_eq!(len, 1);
    cleanup(&mut s, &[]).await;
}

#[tokio::test]
async fn rows_written_to_the_log_are_counted_in_the_state() {
    let mut s = store("log-records").await;
    s.sink = AuditSink::Log;
    let (len, _) = s
        .commit(&[row("a"), row("b")], &[], &[], &Counts::default())
        .await
        .expect("first");
    assert_eq!(len, 2);
    let (len, _) = s
        .commit(&[row("c")], &[], &[], &Counts::default())
        .await
        .expect("second");
    assert_eq!(len, 3);
    let (inv, _) = s.commit_invocation(&[row("d")], &[], &[], &Counts::default());
    let first: Vec<u64> = eval(&mut s.con, commit_script(), &inv)
        .await
        .expect("third");
    let again: Vec<u64> = eval(&mut s.con, commit_script(), &inv)
        .await
        .expect("again");
    assert_eq!(first, vec![4, 0, 1]);
    assert_eq!(again, vec![4, 0, 0], "a retry counts nothing twice");
    let exists: bool = redis::cmd("EXISTS")
        .arg(&s.keys().audit)
        .query_async(&mut s.con)
        .await
        .expect("exists");
    assert!(
        !exists,
        "rows sent to the log are not written to the stream"
    );
    cleanup(&mut s, &[]).await;
}

#[tokio::test]
async fn a_commit_sent_again_after_a_lost_answer_writes_nothing_twice() {
    let mut s = store("commit-once").await;
    let settled = [("fp1".to_string(), "replayed".to_string())];
    let delta = Counts {
        scanned: 2,
        replayed: 2,
        ..Default::default()
    };
    let (inv, _) = s.commit_invocation(&[row("a"), row("b")], &settled, &[], &delta);
    let first: Vec<u64> = eval(&mut s.con, commit_script(), &inv)
        .await
        .expect("first");
    // The same invocation again, as a retry after a timed-out answer sends it.
    let again: Vec<u64> = eval(&mut s.con, commit_script(), &inv)
        .await
        .expect("again");
    assert_eq!(first, vec![2, 0, 1]);
    assert_eq!(again, vec![2, 0, 0], "the retry must apply nothing");
    let state: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(&s.keys().state)
        .query_async(&mut s.con)
        .await
        .expect("state");
    assert_eq!(state.get("c:replayed").map(String::as_str), Some("2"));
    // A new commit (a new id) is applied.
    let (len, _) = s
        .commit(&[row("c")], &[], &[], &Counts::default())
        .await
        .expect("next");
    assert_eq!(len, 3);
    cleanup(&mut s, &[]).await;
}
