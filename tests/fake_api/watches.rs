//! Watches: later changes in order, an expired watch relisting, cluster-wide lists and watches,
//! `timeoutSeconds`.

use super::*;

pub(crate) async fn watch_replays_later_changes_in_order(env: &Env) {
    let api = env.replays();
    let a = api
        .create(&PostParams::default(), &replay("wa", &env.ns))
        .await
        .unwrap();
    let from = a.resource_version().unwrap();
    api.patch(
        "wa",
        &pp(),
        &merge(json!({"metadata": {"labels": {"step": "1"}}})),
    )
    .await
    .unwrap();
    api.create(&PostParams::default(), &replay("wb", &env.ns))
        .await
        .unwrap();
    api.patch_status("wa", &pp(), &merge(json!({"status": {"phase": "Canary"}})))
        .await
        .unwrap();
    api.delete("wb", &DeleteParams::default()).await.unwrap();

    let wp = WatchParams::default().timeout(20);
    let mut stream = api.watch(&wp, &from).await.unwrap().boxed();
    let events = take_events(&mut stream, 4, Duration::from_secs(15)).await;
    let got: Vec<(String, String)> = events
        .iter()
        .map(summarize)
        .map(|(t, n, _)| (t, n))
        .collect();
    let want: Vec<(String, String)> = [
        ("MODIFIED", "wa"),
        ("ADDED", "wb"),
        ("MODIFIED", "wa"),
        ("DELETED", "wb"),
    ]
    .iter()
    .map(|(t, n)| (t.to_string(), n.to_string()))
    .collect();
    assert_eq!(got, want);
    let rvs: Vec<u64> = events.iter().map(|e| summarize(e).2).collect();
    assert!(rvs.windows(2).all(|w| w[0] < w[1]), "{rvs:?}");
    assert!(rvs[0] > from.parse::<u64>().unwrap());
    if let WatchEvent::Modified(o) = &events[2] {
        assert_eq!(o.status.as_ref().unwrap().phase, Some(Phase::Canary));
    }
    // Then live changes.
    api.create(&PostParams::default(), &replay("wc", &env.ns))
        .await
        .unwrap();
    let live = take_events(&mut stream, 1, Duration::from_secs(15)).await;
    assert_eq!(
        live.iter().map(|e| summarize(e).0).collect::<Vec<_>>(),
        ["ADDED"]
    );
    assert_eq!(summarize(&live[0]).1, "wc");

    // A single-object watch (metadata.name field selector) sees only that object.
    let wp = WatchParams::default()
        .fields("metadata.name=wa")
        .timeout(20);
    let mut one = api.watch(&wp, &from).await.unwrap().boxed();
    let events = take_events(&mut one, 2, Duration::from_secs(15)).await;
    assert_eq!(
        events
            .iter()
            .map(summarize)
            .map(|(t, n, _)| (t, n))
            .collect::<Vec<_>>(),
        vec![
            ("MODIFIED".to_string(), "wa".to_string()),
            ("MODIFIED".into(), "wa".into())
        ]
    );
    api.patch(
        "wc",
        &pp(),
        &merge(json!({"metadata": {"labels": {"other": "1"}}})),
    )
    .await
    .unwrap();
    api.patch(
        "wa",
        &pp(),
        &merge(json!({"metadata": {"labels": {"step": "2"}}})),
    )
    .await
    .unwrap();
    let next = take_events(&mut one, 1, Duration::from_secs(15)).await;
    assert_eq!(
        summarize(&next[0]).1,
        "wa",
        "field selector let another object through"
    );
}

pub(crate) async fn expired_watch_relists(env: &Env) {
    let api = env.replays();
    let a = api
        .create(&PostParams::default(), &replay("exp", &env.ns))
        .await
        .unwrap();
    let old = a.resource_version().unwrap();

    // An open watch, to be ended by the expiry.
    let mut open = api
        .watch(&WatchParams::default().timeout(60), &old)
        .await
        .unwrap()
        .boxed();

    // A watcher that has listed.
    let mut w = watcher(api.clone(), watcher::Config::default()).boxed();
    let mut inits = 0;
    let seen_init = tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(ev) = w.next().await {
            match ev {
                Ok(watcher::Event::Init) => inits += 1,
                Ok(watcher::Event::InitDone) => return,
                _ => {}
            }
        }
    })
    .await;
    assert!(seen_init.is_ok(), "watcher did not finish its initial list");

    let expired = env.expire_watches();
    if expired {
        // The open watch ends.
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(Ok(_)) = open.next().await {}
        })
        .await;
        assert!(ended.is_ok(), "open watch did not end on expiry");
        // A watch from before the expiry answers 410 Gone.
        let first = match api.watch(&WatchParams::default().timeout(10), &old).await {
            Ok(s) => s.boxed().try_next().await,
            Err(e) => Err(e),
        };
        match first {
            Ok(Some(WatchEvent::Error(s))) => assert_eq!(s.code, 410, "{s:?}"),
            Err(kube::Error::Api(s)) => assert_eq!(s.code, 410, "{s:?}"),
            other => panic!("expected 410 Gone, got {other:?}"),
        }
    } else {
        let _ = writeln!(
            std::io::stderr(),
            "note: a real cluster cannot be made to expire watches on demand; checking only that the watcher follows later changes"
        );
    }
    drop(open);

    api.patch(
        "exp",
        &pp(),
        &merge(json!({"metadata": {"labels": {"v": "2"}}})),
    )
    .await
    .unwrap();
    let label = |o: &DlqReplay| o.labels().get("v").cloned();
    let saw_v2 = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(ev) = w.next().await {
            match ev {
                Ok(watcher::Event::Init) => inits += 1,
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))
                    if label(&o).as_deref() == Some("2") =>
                {
                    return;
                }
                _ => {}
            }
        }
    })
    .await;
    assert!(
        saw_v2.is_ok(),
        "watcher did not see the change after expiry"
    );
    if expired {
        assert!(
            inits >= 2,
            "watcher did not relist after 410 (inits = {inits})"
        );
    }
    // And it keeps following live changes.
    api.patch(
        "exp",
        &pp(),
        &merge(json!({"metadata": {"labels": {"v": "3"}}})),
    )
    .await
    .unwrap();
    let saw_v3 = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(ev) = w.next().await {
            if let Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = ev {
                if label(&o).as_deref() == Some("3") {
                    return;
                }
            }
        }
    })
    .await;
    assert!(
        saw_v3.is_ok(),
        "watcher did not follow live changes after the relist"
    );
}

pub(crate) async fn cluster_wide_list_and_watch(env: &Env) {
    let ns_api = env.replays();
    let all: Api<DlqReplay> = Api::all(env.client.clone());
    let a = ns_api
        .create(&PostParams::default(), &replay("cw", &env.ns))
        .await
        .unwrap();
    let list = all.list(&ListParams::default()).await.unwrap();
    assert!(list
        .items
        .iter()
        .any(|r| r.name_any() == "cw" && r.namespace().as_deref() == Some(env.ns.as_str())));
    let from = a.resource_version().unwrap();
    let wp = WatchParams::default()
        .fields(&format!("metadata.namespace={}", env.ns))
        .timeout(20);
    let mut stream = all.watch(&wp, &from).await.unwrap().boxed();
    ns_api
        .patch(
            "cw",
            &pp(),
            &merge(json!({"metadata": {"labels": {"w": "1"}}})),
        )
        .await
        .unwrap();
    let events = take_events(&mut stream, 1, Duration::from_secs(15)).await;
    assert_eq!(
        events
            .iter()
            .map(summarize)
            .map(|(t, n, _)| (t, n))
            .collect::<Vec<_>>(),
        vec![("MODIFIED".to_string(), "cw".to_string())]
    );
}

/// A watch with `timeoutSeconds` ends its stream then. (From a listed resourceVersion: from "0"
/// with bookmarks, kube-apiserver v1.36 on etcd 3.5.1 answers an ERROR 500 event, "the required
/// storage feature RequestWatchProgress is disabled".)
pub(crate) async fn watch_timeout_ends_the_stream(env: &Env) {
    let api = env.replays();
    let from = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let started = std::time::Instant::now();
    let mut s = api
        .watch(&WatchParams::default().timeout(1), &from)
        .await
        .unwrap()
        .boxed();
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match s.try_next().await {
                Ok(Some(WatchEvent::Bookmark(_))) => {}
                other => return other,
            }
        }
    })
    .await;
    assert!(matches!(end, Ok(Ok(None))), "{end:?}");
    assert!(started.elapsed() >= Duration::from_millis(900));
}
